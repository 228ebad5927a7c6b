"""Run an example script and SIGKILL it at a chosen moment: a crash for the checkpoint tests, with no hook in the
examples themselves.

    python tests/fault_injection.py save:4 examples/pretrain.py [its arguments]   # while saving checkpoint 4
    python tests/fault_injection.py step:7 examples/pretrain.py [its arguments]   # in optimizer step 7

``save:N``: right after ``Accelerator.save_state`` has written checkpoint N's model, optimizer and RNG files into
the checkpoint's temporary folder, before it is complete. ``step:N``: after step N's backward and gradient
clipping, before its optimizer update (a global optimizer-step pre-hook; the step number comes from the
optimizer's own state, so it counts on across a resume). It works under ``accelerate launch`` and torchrun."""
import os
import re
import runpy
import signal
import sys
from pathlib import Path


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_while_saving(step):
    from accelerate import Accelerator

    save_state = Accelerator.save_state

    def save_state_then_die(self, output_dir=None, *args, **kwargs):
        result = save_state(self, output_dir, *args, **kwargs)
        if output_dir is not None and re.search(rf"checkpoint-{step}(\D|$)", Path(output_dir).name):
            _kill()
        return result

    Accelerator.save_state = save_state_then_die


def kill_in_step(step):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def before_update(optimizer, args, kwargs):
        done = 0
        for state in optimizer.state.values():
            if "step" in state:
                done = int(state["step"])
                break
        if done + 1 == step:
            _kill()

    register_optimizer_step_pre_hook(before_update)


def main():
    where, script, *script_args = sys.argv[1:]
    moment, step = where.split(":")
    {"save": kill_while_saving, "step": kill_in_step}[moment](int(step))
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
