"""The live engine: real offloaded MoE decoding with PyTorch and transformers (`python -m live.record`)."""
