"""Loss provenance in JAX code: `jax.numpy` reductions and optax's per-example losses."""

from __future__ import annotations

import libcst as cst

from gaaudit.analysis.provenance import Origin, Tracer
from gaaudit.analysis.tree import ATOMS, Tree, code, depends_on, keyword, last_name

# optax losses that return one value per example or token (reduced later by the caller).
OPTAX_LOSSES = {
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
    "sigmoid_binary_cross_entropy",
    "l2_loss",
    "squared_error",
    "huber_loss",
    "log_cosh",
    "kl_divergence",
    "cosine_distance",
    "sigmoid_focal_loss",
    "poly_loss_cross_entropy",
    "safe_softmax_cross_entropy",
}
COUNTS = {"sum", "nansum", "count_nonzero"}


class JaxTracer(Tracer):
    """A Tracer that also knows `jax.numpy` reductions and optax's per-example losses."""

    def _call(self, call: cst.Call, depth: int) -> Origin:
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "astype":
            return self.origin(func.value, depth + 1)
        qualified = self.tree.qualified(func) or ""
        home, _, name = qualified.rpartition(".")
        if home == "jax.numpy" and keyword(call, "axis") is None:
            if name in ("mean", "nanmean", "average"):
                return self._mean(call, f"`{code(call)}`")
            if name in ("sum", "nansum"):
                return self._sum(call, f"`{code(call)}`")
        if home.startswith("optax") and name in OPTAX_LOSSES:
            return Origin("elementwise", f"`{name}`, one loss per example or token", call)
        return super()._call(call, depth)

    def valid_count(self, origin: Origin) -> cst.BaseExpression | None:
        """`mask.sum()` for `jnp.mean(x, where=mask)`, else as a Tracer counts."""
        call = origin.source
        if (
            origin.kind == "mean"
            and origin.count is None
            and isinstance(call, cst.Call)
            and self.tree.qualified(call.func) == "jax.numpy.mean"
            and (mask := keyword(call, "where")) is not None
        ):
            if not isinstance(mask, ATOMS) and not mask.lpar:
                mask = mask.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            return cst.Call(cst.Attribute(mask, cst.Name("sum")))
        return super().valid_count(origin)

    def _per_micro_batch(self, expr: cst.CSTNode, divisor: cst.BaseExpression) -> bool:
        """In a loss function: a count reduced from the batch (`jnp.sum(mask)`, `n = mask.sum()`),
        not a count passed in (`window_tokens`, `batch["window_tokens"]`)."""
        function = next(
            (a for a in self.tree.ancestors(expr) if isinstance(a, cst.FunctionDef)), None
        )
        if function is None:
            return super()._per_micro_batch(expr, divisor)
        counted = any(
            isinstance(node, cst.Call) and last_name(node.func) in COUNTS
            for node in self.tree.walk(divisor)
        )
        return counted or depends_on(divisor, self.tree.assigned_in(function.body))


def tracer_for(tree: Tree, imports=None) -> Tracer:
    """A JaxTracer for a module that imports jax, else a Tracer."""
    jax = any(q.split(".")[0] == "jax" for q in tree.imports.values())
    return (JaxTracer if jax else Tracer)(tree, imports)
