"""GPU model services: weights in host RAM, resident on a GPU only while useful, batched requests."""
