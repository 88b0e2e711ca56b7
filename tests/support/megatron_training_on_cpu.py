"""TEST SUPPORT ONLY: what Megatron's distributed optimizer and checkpointing need beyond
tests/support/cuda_on_cpu.py to run in a CPU process. Install after cuda_on_cpu.install().

- Megatron's optimizers sort parameters by `tensor.type()` strings ('torch.cuda.BFloat16Tensor');
  on the CPU that string lacks '.cuda', so it is reported as if the tensor were on the GPU.
- The checkpoint writer logs its memory through psutil, which the CI environment lacks.
- Without Apex / Transformer Engine Megatron falls back to torch's Adam, which keeps a 'step'
  tensor per parameter; the fully reshardable load restores it from the param groups and leaves
  it out of the per-parameter tensors, then indexes them with every state key (KeyError 'step').
  The current step is handed back so that it is copied onto itself. Its load_state_dict also
  gives every parameter the same 'step' tensor, which torch's Adam then increments once per
  parameter: each parameter gets its own copy back."""

import torch


def install() -> None:
    plain_type = torch.Tensor.type

    def type_as_on_cuda(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:  # a conversion, or truly CUDA: unchanged
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_as_on_cuda

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_keeping_step(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = dict(tensors, step=step)
        return set_states(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_keeping_step

    load_state_dict = DistributedOptimizer.load_state_dict

    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps
