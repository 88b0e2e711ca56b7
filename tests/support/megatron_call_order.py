"""Reading MoELayer.forward's step order and data flow from megatron-core's source (the order
FP4MoELayer's protocol rests on, megatron_fp4/integration/moe_layer.py)."""

import ast
import textwrap

STEPS = ("route", "preprocess", "dispatch", "routed_experts_compute", "combine", "postprocess")


def step_calls(source: str):
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


def check_step_calls(source: str) -> None:
    """Assert the step order and hand-over in `source` (MoELayer.forward, or a whole moe_layer.py)."""
    calls = step_calls(source)
    assert [name for name, _, _ in calls] == list(STEPS), calls
    by_step = {name: (arg, target) for name, arg, target in calls}
    # preprocess -> dispatch -> routed_experts_compute carry FP4MoELayer's LayerForward in the tokens' place.
    assert by_step["dispatch"][0] == by_step["preprocess"][1], by_step
    assert by_step["routed_experts_compute"][0] == by_step["dispatch"][1], by_step
    assert by_step["combine"][0] == by_step["routed_experts_compute"][1], by_step
