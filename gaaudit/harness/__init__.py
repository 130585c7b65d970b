"""Runtime checks on tiny real models (GA-GUIDE section 6). Imports torch, transformers and
accelerate, so nothing outside this package may import it at module level.

models (tiny models), data (one window of padded micro-batches), gradcheck (reference, error,
recording optimizer), analysis + stubs + replay (statement replay, check, compare), demo
(mean/K against sum-and-count), distributed (two-process gloo DDP check)."""
