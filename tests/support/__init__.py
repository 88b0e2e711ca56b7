"""Test support: stand-ins for what a CPU-only machine lacks. Never imported by megatron_fp4."""
