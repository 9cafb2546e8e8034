"""The names ``mpsync train --model`` accepts, without importing torch: every rank checks its
flags, and the dedicated server rank, which never builds a model, must not pay for torch's
import on cores it shares with the workers at start-up."""

from __future__ import annotations

__all__ = ["MODELS"]

MODELS = ("auto", "cnn", "mlp", "wide-mlp", "big-mlp", "resnet")
