"""FP4MoELayer relies on the order in which Megatron's MoELayer.forward calls its steps and on each
step's first result going straight into the next (megatron_fp4/integration/moe_layer.py's
docstring). This reads the installed megatron-core's MoELayer.forward and fails if that changes."""

import inspect

from megatron.core.transformer.moe.moe_layer import MoELayer

from support.megatron_call_order import STEPS, check_step_calls, step_calls


def test_moe_layer_forward_calls_the_steps_in_order_and_passes_each_result_on():
    check_step_calls(inspect.getsource(MoELayer.forward))


def test_the_check_notices_a_reordered_forward():
    """The reader is not vacuous: a forward with the experts before the dispatch fails it."""
    reordered = '''
def forward(self, hidden_states):
    def custom_forward(hidden_states):
        probs, routing_map = self.route(hidden_states)
        hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
        output, mlp_bias = self.routed_experts_compute(hidden_states, probs)
        dispatched_input, probs = self.dispatch(output, probs)
        output = self.combine(dispatched_input)
        output = self.postprocess(output, None)
        return output
    return custom_forward(hidden_states)
'''
    assert [name for name, _, _ in step_calls(reordered)] != list(STEPS)
