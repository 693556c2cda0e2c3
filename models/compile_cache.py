"""torch.compile's on-disk cache under kvload's cache directory, not a ``torchinductor_<user>`` folder in ``$TMPDIR``.

Importing ``torch._dynamo`` (transformers' generation code does, so every weight load) creates inductor's cache
directory, and the compiled paged attention (``cache_backends.flex_paged``) keeps its graphs there: by default
``$TMPDIR/torchinductor_<user>``, which a run then leaves behind. kvload points it at ``<kvload cache>/torchinductor``
(``$KVLOAD_CACHE``, else ``$XDG_CACHE_HOME/kvload``, else ``~/.cache/kvload``), as vLLM keeps its compile cache under
``~/.cache/vllm``: a later process reuses the graphs an earlier one compiled. A ``TORCHINDUCTOR_CACHE_DIR`` the user
set (or torch chose, once ``torch._dynamo`` was imported before kvload's first load) stands. Inductor's precompiled
C++ headers ignore that variable (``torch._inductor.codecache`` puts them in ``$TMPDIR/torchinductor_<user>`` on
purpose, to outlive its ``fresh_cache``): :func:`compile_cache_for_flex` moves them under the cache in use as well.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.gguf_cache import cache_root

#: torch's variable naming inductor's cache directory (read each time inductor and dynamo look for it)
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_kvload_compile_cache() -> Path:
    """Set inductor's cache directory to ``<kvload cache>/torchinductor`` unless one is set; the one in use."""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if not chosen:
        chosen = os.environ[INDUCTOR_CACHE_ENV] = str(cache_root() / "torchinductor")
    return Path(chosen)


def compile_cache_for_flex() -> Path:
    """:func:`use_kvload_compile_cache`, and inductor's precompiled headers under it too (where torch's default put
    them in ``$TMPDIR``); the cache directory in use. Imports inductor: only what compiles calls it."""
    cache = use_kvload_compile_cache()
    import torch._inductor.codecache as codecache
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.join(default_cache_dir(), "precompiled_headers")
    # module globals read at each precompile; absent in another torch, whose layout then stands as it is
    if getattr(codecache, "_HEADER_DIR", None) == default and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = str(cache / "precompiled_headers")
        codecache._HEADER_LOCK_DIR = str(cache / "precompiled_headers" / "locks")
    return cache
