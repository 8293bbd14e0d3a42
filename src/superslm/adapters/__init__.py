"""adapters layer: LoRA adapters from PEFT folders, applied per request with grouped low-rank matmuls."""

from superslm.adapters.lora import Adapter, LoraBatch, group_rows, load_peft

__all__ = ["Adapter", "LoraBatch", "group_rows", "load_peft"]
