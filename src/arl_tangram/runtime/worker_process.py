"""A sandbox worker process's entry point: ``python -m arl_tangram.runtime.worker_process``
(``SandboxWorkers`` starts it; its code is ``workers.main``).

A module of its own, which nothing imports: the package's ``__init__`` imports ``workers``, so
``-m arl_tangram.runtime.workers`` ran that module a second time as ``__main__`` beside the copy the
package had imported (two of each of its classes in the process), and runpy printed a RuntimeWarning
for each worker at every server start.
"""

from .workers import main

if __name__ == "__main__":
    main()
