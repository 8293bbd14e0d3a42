"""quant layer."""
