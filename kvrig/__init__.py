"""kvrig: plan, package, deploy and soak-test quantized LLMs on iPhone."""

__version__ = "0.1.0"
