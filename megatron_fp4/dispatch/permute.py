"""The all-to-all dispatcher's permute and unpermute without atomics or identity copies, as a mixin
of Megatron's MoEAlltoAllTokenDispatcher (`LeanPermute`).

Megatron's unfused permute gathers each token's copies (`index_select`) and its unpermute adds the
experts' rows back per token (`scatter_add_`); the gathers are fast, the sums are BF16 atomics:
on one H200 at DeepSeek-V3's layer (4096 tokens, top-8, hidden 7168) the permute's gradient
(`index_add_`) and the unpermute took 2.7 ms of a 22 ms forward+backward. Here every sum reads a
token's rows from a table of positions grouped by token and writes the token once. The gathers stay
as they are; with --moe-permute-fusion Megatron runs Transformer Engine's fused kernels instead and
these sums are not used. With expert and tensor parallel size 1 the parent's sort of the received
rows by local expert (and its unsort) is the identity: it is skipped instead of copying every row.
"""

from dataclasses import dataclass

import torch

from ..kernels.row_sums import sum_rows_by_token


@dataclass(frozen=True)
class TokenRows:
    """Where each token's copies are among the permuted rows: indices[p] is the token of row p
    (Megatron's sorted indices); order lists the rows grouped by token, ascending within a token;
    token t owns order[offsets[t]:offsets[t + 1]]."""

    indices: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor

    @staticmethod
    def of(indices: torch.Tensor, num_tokens: int) -> "TokenRows":
        # 32-bit keys: half the radix sort's passes (and launches) of int64 ones.
        keys = indices.to(torch.int32)
        order = torch.argsort(keys, stable=True)
        # Where each token's run starts among the sorted tokens; torch.bincount would wait for the GPU.
        tokens = torch.arange(num_tokens + 1, dtype=torch.int32, device=indices.device)
        return TokenRows(indices.to(torch.int64), order, torch.searchsorted(keys[order], tokens))

    def sums(self, rows: torch.Tensor) -> torch.Tensor:
        """[num_tokens, H]: each token's rows added (fp32, one rounding)."""
        return sum_rows_by_token(rows, self.order, self.offsets)


class _PermutedTokens(torch.autograd.Function):
    """tokens[indices], already gathered: forward hands the gathered rows on, backward sums each
    token's gradients."""

    @staticmethod
    def forward(ctx, tokens, gathered, rows: TokenRows):
        ctx.rows = rows
        return gathered

    @staticmethod
    def backward(ctx, grad):
        return ctx.rows.sums(grad.contiguous()), None, None


class _UnpermutedTokens(torch.autograd.Function):
    """out[t] = sum of the rows of token t; backward gathers the output gradient back to the rows."""

    @staticmethod
    def forward(ctx, permuted, rows: TokenRows):
        ctx.rows = rows
        return rows.sums(permuted)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.rows.indices), None


def permuted_tokens(tokens: torch.Tensor, gathered: torch.Tensor, rows: TokenRows) -> torch.Tensor:
    """`gathered` (= tokens[rows.indices], computed by Megatron's permute) as a function of tokens
    [T, H] whose gradient is summed per token without atomics. The gather's own graph node, left
    unused, never runs."""
    return _PermutedTokens.apply(tokens, gathered.detach(), rows)


def permuted_stand_in(tokens: torch.Tensor, rows: TokenRows) -> torch.Tensor:
    """[R, H]: the permute of tokens [T, H] when it was done on their MXFP4 rows instead: no values
    (one element, expanded: nothing reads it), only the gradient path, whose backward sums each
    token's rows as permuted_tokens does."""
    stand_in = tokens.new_empty(()).expand(rows.indices.shape[0], tokens.shape[1])
    return _PermutedTokens.apply(tokens, stand_in, rows)


def unpermuted_tokens(permuted: torch.Tensor, rows: TokenRows) -> torch.Tensor:
    """[T, H]: the rows of each token added, the inverse of the permute (the combine's last step)."""
    return _UnpermutedTokens.apply(permuted, rows)


class LeanPermute:
    """Mixin for MoEAlltoAllTokenDispatcher (listed before it): the same steps and host sync
    points, the sums without atomics (unless --moe-permute-fusion) and no identity chunk sort."""

    def _atomic_free_sums(self) -> bool:
        # Megatron's unfused permute sums rows with atomics; its fused one (Transformer Engine) does not.
        return not self.config.moe_permute_fusion

    def _token_rows(self) -> TokenRows:
        """Where the permute of this forward put each token's copies; computed once for the
        permute's mapping (the dispatch and the combine of a forward read the same one)."""
        mapping = self.reversed_local_input_permutation_mapping
        memo = getattr(self, "_token_rows_of_mapping", None)
        if memo is None or memo[0] is not mapping:
            memo = (mapping, TokenRows.of(mapping, self.hidden_shape_before_permute[0]))
            self._token_rows_of_mapping = memo
        return memo[1]

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """The parent's permute, its gradient summed per token without atomics."""
        tokens, permuted_probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
        if self._atomic_free_sums() and torch.is_grad_enabled() and hidden_states.requires_grad:
            tokens = permuted_tokens(hidden_states.view(-1, hidden_states.shape[-1]), tokens, self._token_rows())
        return tokens, permuted_probs

    def one_source_rank(self) -> bool:
        """Expert and tensor parallel size 1: the received rows come from this rank alone, already
        sorted by local expert, so the parent's chunk sort and unsort would copy them unchanged."""
        return self.tp_size * self.ep_size == 1

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """The parent's, without the chunk sort where it is the identity; the same host sync points."""
        if not self.one_source_rank():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", self.tokens_per_expert)
        tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        """The parent's (chunk unsort, tensor-parallel reduce-scatter): nothing to do for one source rank."""
        if self.one_source_rank():
            return hidden_states
        return super().combine_preprocess(hidden_states)

    def combine_postprocess(self, permutated_local_input_tokens):
        """The parent's unpermute and shared-expert add, the unpermute's sums without atomics."""
        if not self._atomic_free_sums():
            return super().combine_postprocess(permutated_local_input_tokens)
        output = unpermuted_tokens(permutated_local_input_tokens, self._token_rows()).view(self.hidden_shape)
        if self.shared_experts is not None:
            output += self.shared_experts.get_output()
        return output


__all__ = ["LeanPermute", "TokenRows", "permuted_stand_in", "permuted_tokens", "unpermuted_tokens"]
