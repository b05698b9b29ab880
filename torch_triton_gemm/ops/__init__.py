"""The tgemm operators; importing a module registers its op under ``torch.ops.tgemm``."""
