"""FP4MoELayer relies on the order in which Megatron's MoELayer.forward calls its steps and on each
step's first result going straight into the next (megatron_fp4/integration/moe_layer.py's
docstring). This reads the installed megatron-core's MoELayer.forward and fails if that changes."""

import ast
import inspect
import textwrap

from megatron.core.transformer.moe.moe_layer import MoELayer

STEPS = ("route", "preprocess", "dispatch", "routed_experts_compute", "combine", "postprocess")


def _step_calls(source: str):
    """[(step, first argument's name, first assigned name)] of the self.<step>(...) calls in
    forward's inner custom_forward, in source order."""
    tree = ast.parse(textwrap.dedent(source))
    inner = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "custom_forward")
    calls = []
    for node in ast.walk(inner):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        func = node.value.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
                and func.attr in STEPS):
            continue
        target = node.targets[0]
        first_target = target.elts[0] if isinstance(target, ast.Tuple) else target
        first_arg = node.value.args[0] if node.value.args else None
        calls.append((node.lineno, func.attr, getattr(first_arg, "id", None), getattr(first_target, "id", None)))
    return [call[1:] for call in sorted(calls)]


def test_moe_layer_forward_calls_the_steps_in_order_and_passes_each_result_on():
    calls = _step_calls(inspect.getsource(MoELayer.forward))
    assert [name for name, _, _ in calls] == list(STEPS), calls
    by_step = {name: (arg, target) for name, arg, target in calls}
    # preprocess -> dispatch -> routed_experts_compute carry FP4MoELayer's LayerForward in the tokens' place.
    assert by_step["dispatch"][0] == by_step["preprocess"][1], by_step
    assert by_step["routed_experts_compute"][0] == by_step["dispatch"][1], by_step
    assert by_step["combine"][0] == by_step["routed_experts_compute"][1], by_step


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
    assert [name for name, _, _ in _step_calls(reordered)] != list(STEPS)
