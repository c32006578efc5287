"""`dpscale run`: a user's torchrun script, unchanged, with dpscale's engine standing in for torch's DDP."""
