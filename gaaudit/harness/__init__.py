"""Harness: replay a loop on tiny real models (GA-GUIDE section 6). Imports torch, transformers
and accelerate, so nothing outside this package may import it at module level.

In: the loops and patched source that `commands.verify` picked with the analysis and fixes.
Out: each loop's gradient error against one full-batch step, original and patched.

models + nets (tiny models: language models, image, segmentation, regression, an
encoder-decoder pair), data (one window of padded micro-batches), gradcheck (reference, error,
recording optimizer), analysis + surroundings (what a statement needs: roles, the code around
it), bindings + stubs (the objects bound to its names), replay (statement replay, check,
compare), demo (mean/K against sum-and-count), distributed (replay on N DDP processes),
factory (the user's own model)."""
