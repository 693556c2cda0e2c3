"""torch.compile's on-disk cache under kvload's cache directory, not a ``torchinductor_<user>`` folder in ``$TMPDIR``.

Importing ``torch._dynamo`` (transformers' generation code does, so every weight load) creates inductor's cache
directory, and the compiled paged attention (``cache_backends.flex_paged``) keeps its graphs there: by default
``$TMPDIR/torchinductor_<user>``, which a run then leaves behind. kvload points it at ``<kvload cache>/torchinductor``
(``$KVLOAD_CACHE``, else ``$XDG_CACHE_HOME/kvload``, else ``~/.cache/kvload``), as vLLM keeps its compile cache under
``~/.cache/vllm``: a later process reuses the graphs an earlier one compiled. A ``TORCHINDUCTOR_CACHE_DIR`` the user
set (or torch chose, once ``torch._dynamo`` was imported before kvload's first load) stands. Inductor's precompiled
C++ headers ignore that variable (``torch._inductor.codecache`` puts them in ``$TMPDIR/torchinductor_<user>`` on
purpose, to outlive its ``fresh_cache``): ``cache_backends.flex_paged.compiled_flex`` moves them under the cache in
use as well (the backends sit below this layer, so they read the variable this module set).
"""

from __future__ import annotations

import os

from models.gguf_cache import cache_root

#: torch's variable naming inductor's cache directory (read each time inductor and dynamo look for it)
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_kvload_compile_cache() -> str | None:
    """Set inductor's cache directory to ``<kvload cache>/torchinductor`` unless one is set; why not, else None.

    A kvload cache that cannot be created (a read-only or missing ``$HOME``) leaves the variable unset: torch's own
    default (``$TMPDIR/torchinductor_<user>``) serves, where the variable set would make transformers' import fail.
    """
    if os.environ.get(INDUCTOR_CACHE_ENV):
        return None
    wanted = cache_root() / "torchinductor"
    try:
        wanted.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return (f"the kvload cache {wanted} cannot be created: {exc.strerror or exc}; torch.compile keeps its cache "
                "in torch's default directory ($TMPDIR/torchinductor_<user>)")
    os.environ[INDUCTOR_CACHE_ENV] = str(wanted)
    return None
