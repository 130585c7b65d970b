"""Runtime checks: replay a training loop on tiny real models and compare its gradient with one
full batch (GA-GUIDE section 6). Imports torch and transformers; load it lazily."""
