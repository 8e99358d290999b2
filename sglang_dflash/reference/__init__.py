"""The pure-PyTorch reference engine (oracle for every other path)."""
from .engine import GenerationResult, ReferenceEngine
from .target import HFTarget

__all__ = ["GenerationResult", "HFTarget", "ReferenceEngine"]
