"""``tangram bench modelapi``: what the model protocols cost over the native API, and how fast a
model service decodes.

``overhead``: the same tokens through the native model routes and through each protocol, one
request at a time (each its own batch), in the server's own app in this process (the ASGI app
called directly: no sockets, the same stack either way), one request of every route in turn;
per route the median latency and CPU time (the model's forward on one thread), and what each
protocol adds per request over the native call of the same op (the target: at most
0.3 ms), each round's difference to the native call of the same round, medians (the reward
routes' also less the tokenizing a caller of the native API does before it sends the text's
tokens, timed in the same rounds); and what streaming a chat of ``STREAM_TOKENS`` tokens adds
over the same chat answered whole (``stream_added``).

``decode``: tokens/s of the ``generate`` op's decode loop at each batch size against
transformers' ``generate`` on the same model and batch (greedy, equal-length random prompts,
every row generating ``new_tokens``), alternating, medians; beside them the bound of a step that
reads every weight once from device memory (weight bytes over the measured copy bandwidth: the
KV cache's reads not counted, so the true bound is lower at long contexts). ``--shape
qwen2.5-0.5b`` (or ``qwen2.5-1.5b``) builds a model of that shape with random weights in
``--dtype`` (bfloat16 on CUDA); ``tiny`` is for CPU checks only.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from typing import Callable

SECTIONS = ("overhead", "decode")

#: model shapes the decode section builds (Hugging Face Qwen2 configs, random weights)
SHAPES = {
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=True),
}

#: the most a protocol may add per request over the native call (the bench reports against it)
TARGET_ADDED_MS = 0.3
#: tokens of the chat the overhead section answers whole and streamed
STREAM_TOKENS = 16

CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris.",
          "def add(a, b):\n    return a + b\n", "Reinforcement learning from verifiable rewards."]


def model_dir(path: str, arch: str, seed: int = 0) -> str:
    """A tiny Hugging Face model with random weights and a byte-level BPE tokenizer (trained on a
    few sentences) with a ChatML template, saved to ``path``: ``arch`` ``lm`` (Qwen2 causal LM)
    or ``rm`` (a Qwen2 reward model)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    shape = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = (Qwen2ForCausalLM(Qwen2Config(**shape)) if arch == "lm"
             else Qwen2ForSequenceClassification(Qwen2Config(**shape, num_labels=1)))
    model.save_pretrained(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[2],
                                   pad_token=specials[0])
    fast.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                          "{% endif %}")
    fast.save_pretrained(path)
    return path


def _stats(walls: list[float], cpus: list[float]) -> dict:
    return {"n": len(walls), "median_ms": round(statistics.median(walls) * 1e3, 4),
            "mean_ms": round(statistics.fmean(walls) * 1e3, 4),
            "cpu_median_ms": round(statistics.median(cpus) * 1e3, 4)}


def overhead(device: str = "cpu", requests: int = 300, tokens: int = 32, log: Callable[[str], None] = print) -> dict:
    """Each protocol's added latency per request over the native call of the same op and tokens."""
    import httpx

    from ..managers.models.spec import ModelServiceConfig
    from ..runtime import LocalRuntime
    from ..server import modelapi
    from ..server.app import create_app
    from ..server.calls import with_dialects
    from ..server.service import Service

    root = tempfile.mkdtemp(prefix="tangram-bench-modelapi-")
    lm, rm = model_dir(os.path.join(root, "lm"), "lm", 1), model_dir(os.path.join(root, "rm"), "rm", 2)
    from transformers import AutoTokenizer

    ids = [(7 * i + 3) % 300 + 3 for i in range(tokens)]
    text = " ".join(CORPUS)
    tokenizer = AutoTokenizer.from_pretrained(rm)
    text_ids = tokenizer(text)["input_ids"]
    encode = tokenizer.backend_tokenizer.encode  # as the model service tokenizes a text (``decode.Codec``)
    config = modelapi.ModelApiConfig(reward_routes=[{"path": "/openrlhf", "model": "rm", "shape": "openrlhf"},
                                                    {"path": "/slime", "model": "rm", "shape": "slime"}])
    dialects = with_dialects(settings={"modelapi": config.model_dump()})  # as tangram serve's [model_api]
    models = [ModelServiceConfig("lm", hf=lm, task="logprobs", max_wait_ms=0, max_batch=1),
              ModelServiceConfig("rm", hf=rm, task="score", max_wait_ms=0, max_batch=1)]
    chat = {"model": "lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": STREAM_TOKENS,
            "temperature": 0, "ignore_eos": True}
    routes = {  # name: (op it is compared with, path, body)
        "native logprobs": ("logprobs", "/v1/models/lm/logprobs", {"tokens": ids}),
        "sglang /generate": ("logprobs", "/generate", {"input_ids": ids, "return_logprob": True,
                                                       "logprob_start_len": 0,
                                                       "sampling_params": {"max_new_tokens": 0}}),
        "openai /v1/completions echo": ("logprobs", "/v1/completions", {"model": "lm", "prompt": ids, "max_tokens": 0,
                                                                       "echo": True, "logprobs": 0}),
        "vllm /v1/completions prompt_logprobs": ("logprobs", "/v1/completions",
                                                 {"model": "lm", "prompt": ids, "max_tokens": 0,
                                                  "prompt_logprobs": 0}),
        "native score": ("score", "/v1/models/rm/score", {"tokens": ids}),
        "vllm /classify": ("score", "/classify", {"model": "rm", "input": ids}),
        "vllm /pooling": ("score", "/pooling", {"model": "rm", "input": ids}),
        "sglang /v1/embeddings": ("score", "/v1/embeddings", {"model": "rm", "input": ids}),
        "native score (text's tokens)": ("text", "/v1/models/rm/score", {"tokens": text_ids}),
        "openrlhf reward": ("text", "/openrlhf", {"query": [text], "prompts": [""], "labels": [None]}),
        "slime reward": ("text", "/slime", {"prompt": text, "response": "", "label": None}),
        # streaming's own cost: the same chat, whole and a chunk per token
        "openai chat": ("chat", "/v1/chat/completions", chat),
        "openai chat streamed": ("stream", "/v1/chat/completions", {**chat, "stream": True}),
    }
    native = {"logprobs": "native logprobs", "score": "native score", "text": "native score (text's tokens)",
              "stream": "openai chat"}

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the model's forward on one core: the process's CPU time is the request's

    async def main() -> dict:
        service = Service(LocalRuntime(sandboxes=False, models=models, model_device=device))
        app = create_app(service, dialects=dialects)
        await service.start()
        walls: dict[str, list[float]] = {k: [] for k in routes}
        cpus: dict[str, list[float]] = {k: [] for k in routes}
        tokenize: list[float] = []
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
                for name, (_, path, body) in routes.items():  # warm: every op's first calls
                    for _ in range(5):
                        r = await client.post(path, json=body)
                        if r.status_code != 200:
                            raise RuntimeError(f"{name}: {r.status_code} {r.text[:300]}")
                for _ in range(requests):  # one request of every route in turn: drift hits them alike
                    for name, (_, path, body) in routes.items():
                        t, c = time.perf_counter(), time.process_time()
                        await client.post(path, json=body)
                        walls[name].append(time.perf_counter() - t)
                        cpus[name].append(time.process_time() - c)
                    c = time.process_time()
                    encode(text)  # what a caller of the native API does before it can send the text's tokens
                    tokenize.append(time.process_time() - c)
        finally:
            await service.stop()
        out: dict = {"routes": {k: _stats(walls[k], cpus[k]) for k in routes}}
        added = {}
        for name, (op, _, _) in routes.items():
            if name == native.get(op, name):
                continue
            base = native[op]
            added[name] = {  # each round's difference to the native call of the same round: drift cancels
                "added_ms": round(statistics.median(a - b for a, b in zip(walls[name], walls[base])) * 1e3, 4),
                "added_cpu_ms": round(statistics.median(a - b for a, b in zip(cpus[name], cpus[base])) * 1e3, 4)}
            if op == "text":  # the native call was given the text's tokens: its caller tokenized the text
                added[name]["added_cpu_ms_less_tokenizing"] = round(statistics.median(
                    a - b - k for a, b, k in zip(cpus[name], cpus[base], tokenize)) * 1e3, 4)
        streamed = added.pop("openai chat streamed")
        out["added_over_native"] = added
        out["stream_added"] = {**streamed, "tokens": STREAM_TOKENS,  # over the same chat answered whole
                               "added_cpu_ms_per_token": round(streamed["added_cpu_ms"] / STREAM_TOKENS, 4)}
        out["tokenize_cpu_ms"] = round(statistics.median(tokenize) * 1e3, 4)
        out["target_added_ms"] = TARGET_ADDED_MS
        out["within_target"] = all(v["added_cpu_ms"] <= TARGET_ADDED_MS for v in added.values())
        return out

    log(f"overhead: {len(routes)} routes, {requests} requests each, {tokens} tokens, device {device}")
    try:
        return asyncio.run(main())
    finally:
        torch.set_num_threads(threads)


def copy_bandwidth_gbps(device: str, nbytes: int) -> float:
    """Device memory bandwidth as a copy measures it: bytes read plus written per second."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def decode(device: str = "cpu", shape: str = "tiny", batches: tuple[int, ...] = (1, 32), new_tokens: int = 64,
           prompt_len: int = 32, runs: int = 3, dtype: str | None = None, bandwidth_gbps: float | None = None,
           log: Callable[[str], None] = print) -> dict:
    """The ``generate`` op's decode tokens/s against transformers' ``generate``, per batch size."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ..managers.models import decode as dec
    from ..managers.models.generation import Generate, Sampling

    cuda = device.startswith("cuda")
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if cuda else torch.float32)
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dt).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = bandwidth_gbps or copy_bandwidth_gbps(device, (1 << 30) if cuda else (256 << 20))
    codec = dec.Codec(None, shape)
    out: dict = {"shape": shape, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                 "dtype": str(dt).removeprefix("torch."), "weight_gb": round(weight_bytes / 1e9, 4),
                 "copy_bandwidth_gbps": round(bw, 1), "bandwidth_given": bandwidth_gbps is not None,
                 "new_tokens": new_tokens, "prompt_len": prompt_len, "batches": {}}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(3, config.vocab_size, (b, prompt_len), generator=g)

        def ours() -> list:
            reqs = [Generate(ids=row.tolist(), sampling=Sampling(max_new_tokens=new_tokens, temperature=0.0,
                                                                 ignore_eos=True)) for row in prompts]
            return dec.generate(model, codec, frozenset(), reqs)

        def theirs():
            ids = prompts.to(device)
            with torch.inference_mode():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

        times: dict[str, list[float]] = {"tangram": [], "transformers": []}
        first = ours()
        ref = theirs()  # warm both, and check they agree
        same = sum(a.output_ids == ref[i, prompt_len:].tolist() for i, a in enumerate(first))
        for _ in range(runs):
            for name, fn in (("tangram", ours), ("transformers", theirs)):
                sync()
                t = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t)
        row = {}
        for name, ts in times.items():
            s = statistics.median(ts)
            row[name] = {"seconds": round(s, 4), "tokens_per_s": round(b * new_tokens / s, 1)}
        row["ratio"] = round(row["tangram"]["tokens_per_s"] / row["transformers"]["tokens_per_s"], 3)
        row["bound_tokens_per_s"] = round(b * bw * 1e9 / weight_bytes, 1)
        row["rows_identical_to_transformers"] = f"{same}/{b}"
        out["batches"][str(b)] = row
        log(f"decode batch {b}: tangram {row['tangram']['tokens_per_s']} tok/s, transformers "
            f"{row['transformers']['tokens_per_s']} tok/s ({row['ratio']}x), bound {row['bound_tokens_per_s']}")
    return out


def run(device: str = "auto", sections: tuple[str, ...] = SECTIONS, requests: int = 300, shape: str | None = None,
        batches: tuple[int, ...] = (1, 32), new_tokens: int = 64, prompt_len: int = 32, runs: int = 3,
        dtype: str | None = None, bandwidth_gbps: float | None = None, log: Callable[[str], None] = print) -> dict:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict = {"device": device}
    if "overhead" in sections:
        out["overhead"] = overhead("cuda" if device.startswith("cuda") else "cpu", requests, log=log)
    if "decode" in sections:
        out["decode"] = decode(device, shape or ("qwen2.5-0.5b" if device.startswith("cuda") else "tiny"), batches,
                               new_tokens, prompt_len, runs, dtype, bandwidth_gbps, log)
    return out
