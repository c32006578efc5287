"""dpscale's Accelerator in place of accelerate's in every Python process started with this folder
first on PYTHONPATH (Accelerate's own scripts, unchanged); DPSCALE_SWAP=0 leaves accelerate's."""

import os

if os.environ.get("DPSCALE_SWAP", "1") != "0":
    import accelerate
    import accelerate.accelerator

    from dpscale.integrations.accelerate import Accelerator

    accelerate.Accelerator = Accelerator
    accelerate.accelerator.Accelerator = Accelerator
