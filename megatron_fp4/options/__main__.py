"""`python -m megatron_fp4.options`: print the tables of docs/usage.md."""

from .usage_table import usage_markdown

if __name__ == "__main__":
    print(usage_markdown(), end="")
