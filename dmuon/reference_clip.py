"""The reference implementation's clipping methods on its optimizer: they clip the
Muon gradients only and keep the last ``MuonGradClipStats``."""


class ReferenceClipMethods:
    """The reference's clipping methods on its optimizer, mixed into ``dmuon.Muon``."""

    def clip_grad_norm_(self, max_norm, *, norm_type=None, error_if_nonfinite=None,
                        foreach=None, strategy=None):
        """The reference's method: clip the Muon gradients only (``strategy``, default
        ``"global_norm"``; ``dmuon.muon_clip``) and keep the ``MuonGradClipStats`` for
        ``last_muon_grad_clip_stats()``."""
        from .grads import clip_grad_norm_  # grads imports the optimizer; break the cycle

        self._last_clip_stats = clip_grad_norm_(
            self, max_norm, norm_type=2.0 if norm_type is None else norm_type,
            error_if_nonfinite=bool(error_if_nonfinite), foreach=foreach,
            strategy=strategy or "global_norm")
        return self._last_clip_stats

    def last_muon_grad_clip_stats(self):
        """The ``MuonGradClipStats`` of the last ``clip_grad_norm_`` call (None before)."""
        return getattr(self, "_last_clip_stats", None)
