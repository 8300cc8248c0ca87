"""Small C helpers, compiled at first use with the system's C compiler and loaded with ctypes.

megatron-core compiles its `helpers_cpp` at first use too; ours are plain C (no pybind11, no
Python headers), built with `$CC`, else `cc`, `gcc` or `clang`, into a cache directory
(`$MEGATRON_SMP_HELPERS_DIR`, else `$XDG_CACHE_HOME/megatron_smp` or `~/.cache/megatron_smp`,
else the temp directory), keyed by a hash of the source, the flags, the compiler and the
machine, so every process after the first just loads the library. Each helper has a pure
Python/numpy path giving the same results: without a working compiler `load_library` returns
None after one warning naming that path, and `MEGATRON_SMP_NO_COMPILED_HELPERS=1` forces it.

  data/helpers.c     the dataset index builders (`megatron_smp.data.compiled`)
  native/crc32.c     zlib's CRC-32 with carry-less multiplies (`megatron_smp.native.checksum`)
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Callable, Dict, List, Optional

logger = logging.getLogger(__name__)

DISABLE_ENV = "MEGATRON_SMP_NO_COMPILED_HELPERS"
_loaded: Dict[str, Optional[ctypes.CDLL]] = {}


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "0") not in ("", "0")


def _compiler() -> Optional[List[str]]:
    configured = os.environ.get("CC")
    if configured:
        return configured.split()
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _cache_dirs() -> List[str]:
    configured = os.environ.get("MEGATRON_SMP_HELPERS_DIR")
    if configured:
        return [configured]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(base, "megatron_smp"), os.path.join(tempfile.gettempdir(), "megatron_smp")]


def _build(compiler: List[str], source_path: str, flags: List[str], stem: str,
           fallback: str) -> Optional[str]:
    """The path of the compiled library, compiling it if no cache directory holds it yet."""
    with open(source_path, "rb") as handle:
        source = handle.read()
    key = hashlib.sha1(
        source + " ".join(compiler + flags).encode() + platform.machine().encode()
    ).hexdigest()[:16]
    name = f"{stem}-{key}.so"
    errors = []
    for directory in _cache_dirs():
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
        try:
            os.makedirs(directory, exist_ok=True)
            # Ranks sharing the directory may compile at once: each writes its own file and
            # the atomic rename leaves one complete library.
            tmp_path = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
            result = subprocess.run(compiler + flags + ["-o", tmp_path, source_path],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                if os.path.exists(tmp_path):
                    os.remove(tmp_path)
                errors.append(f"{' '.join(compiler)} failed: {result.stderr.strip()[-500:]}")
                break  # another directory will not fix the source or the compiler
            os.replace(tmp_path, path)
            return path
        except (OSError, subprocess.SubprocessError) as error:
            errors.append(f"{directory}: {error}")
    logger.warning("megatron_smp: cannot build %s (%s); %s", os.path.basename(source_path),
                   "; ".join(errors), fallback)
    return None


def load_library(source_path: str, flags: List[str], declare: Callable[[ctypes.CDLL], None],
                 fallback: str) -> Optional[ctypes.CDLL]:
    """The library built from `source_path` with `flags`, its functions typed by `declare`;
    None (after one warning ending in `fallback`, what runs instead) without a compiler, when
    the build or the load fails, or when MEGATRON_SMP_NO_COMPILED_HELPERS=1. Once per process."""
    if disabled():
        return None
    if source_path in _loaded:
        return _loaded[source_path]
    _loaded[source_path] = None
    compiler = _compiler()
    if compiler is None:
        logger.warning("megatron_smp: no C compiler found ($CC, cc, gcc, clang) for %s; %s; "
                       "install gcc", os.path.basename(source_path), fallback)
        return None
    stem = "msmp_" + os.path.splitext(os.path.basename(source_path))[0]
    path = _build(compiler, source_path, flags, stem, fallback)
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
        declare(library)
    except (OSError, AttributeError) as error:
        logger.warning("megatron_smp: cannot load %s (%s); %s", path, error, fallback)
        return None
    _loaded[source_path] = library
    return library


def address(array) -> int:
    """The data pointer of a C-contiguous numpy array, for ctypes."""
    return array.ctypes.data


__all__ = ["DISABLE_ENV", "address", "disabled", "load_library"]
