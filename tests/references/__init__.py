"""megazero against code it does not own: torch's loop, DDP, FSDP2, GradScaler, FLOP counter, torch.distributed."""
