"""Tiny plain-torch models, samples and reference losses for the kinds that are not language
models: image classification (`image`), per-pixel segmentation (`segment`), regression
(`regression`), an encoder-decoder called as two models (`pair`) or by keywords (`keyed`),
a model that scores its token sequence itself (`sequence`), one that scores its
spectrogram frames itself (`frames`), a masked autoencoder that scores its reconstruction of
each image's masked patches itself (`masked`), and the parts of a latent-diffusion loop
(`latent`): a denoiser that is also its text encoder, an autoencoder, a noise schedule, and
the diffusion and timestep sampler of openai's diffusion trainers."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from gaaudit.harness.analysis import BATCH_KEYS

NET_KINDS = (
    "image",
    "segment",
    "regression",
    "pair",
    "keyed",
    "sequence",
    "frames",
    "masked",
    "latent",
)
PAD_ID = 0  # the padding of the harness's token sequences (their tokens start at 2)
# Kinds whose samples are token sequences of varied length, padded with PAD_ID in a batch.
PADDED_KINDS = ("pair", "keyed", "sequence")
# Kinds whose samples hold as many targets each, none ignored (one: an image or a sequence
# classified, a regression; every element of equal latents; a masked autoencoder's share of
# each image's patches): the valid count of a micro-batch follows its number of samples, so
# the harness makes the micro-batches differ in size.
SIZED_KINDS = ("image", "regression", "classify", "pooled", "latent", "masked")
# Kinds whose loops draw noise of their own: the reference is the loop's own step on the whole
# window as one micro-batch (see replay._Session), not a loss of the harness's.
NOISED_KINDS = ("latent",)
CLASSES = 10
IMAGE_SHAPE = (3, 8, 8)
FEATURES, TARGETS = 6, 3
WIDTH = 16
CHANNELS = 8  # of a spectrogram frame
PROMPT = 6  # tokens of a latent-diffusion caption, padded to one length as CLIP's tokenizer does
TIMESTEPS = 1000  # of the latent kind's noise schedule
PATCH = 2  # the side of a masked autoencoder's square patches
# of an image's patches, those a masked autoencoder masks: MAE's default ratio, 0.75
MASKED = 3 * (IMAGE_SHAPE[1] // PATCH) * (IMAGE_SHAPE[2] // PATCH) // 4


class TinyImageClassifier(nn.Module):
    """`forward(images (B, 3, H, W)) -> logits (B, CLASSES)`."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(IMAGE_SHAPE[0], WIDTH, 3, padding=1)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images):
        return self.head(F.relu(self.conv(images)).mean(dim=(2, 3)))


class TinySegmenter(nn.Module):
    """`forward(images (B, 3, H, W)) -> per-pixel logits (B, CLASSES, H, W)`."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(IMAGE_SHAPE[0], WIDTH, 3, padding=1)
        self.classify = nn.Conv2d(WIDTH, CLASSES, 1)

    def forward(self, images):
        return self.classify(F.relu(self.conv(images)))


class TinyRegressor(nn.Module):
    """`forward(x (B, FEATURES)) -> predictions (B, TARGETS)`."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, TARGETS))

    def forward(self, x):
        return self.mlp(x)


class TinyEncoder(nn.Module):
    """`forward(src (B, S)) -> (outputs (B, S, W), state (B, W))`; PAD_ID is masked out, so
    that the result does not depend on how wide the batch is padded."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)

    def forward(self, src):
        mask = (src != PAD_ID).unsqueeze(-1)
        outputs = self.embed(src.clamp_min(0)) * mask
        return outputs, outputs.sum(1) / mask.sum(1).clamp_min(1)


class TinyDecoder(nn.Module):
    """`forward(target_in (B, T), *encoder_results) -> log-probabilities (B, T, vocab)`,
    conditioned on the encoder's state (its last 2-D tensor). Position-wise, so padding does
    not change the other positions; negative ids (an ignore value used as padding) read as 0."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.out = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, vocab))

    def forward(self, target_in, *encoder_results):
        flat = [t for r in encoder_results for t in (r if isinstance(r, tuple) else (r,))]
        states = [t for t in flat if isinstance(t, torch.Tensor) and t.dim() == 2]
        hidden = self.embed(target_in.clamp_min(0))
        if states:
            hidden = hidden + states[-1].unsqueeze(1)
        return F.log_softmax(self.out(hidden), dim=-1)


class TinyPair(nn.Module):
    """An encoder and a decoder that a loop calls as two models: `dec(tgt[:, :-1], *enc(src))`,
    scored against `tgt[:, 1:]`."""

    def __init__(self, vocab: int):
        super().__init__()
        self.encoder, self.decoder = TinyEncoder(vocab), TinyDecoder(vocab)

    def forward(self, src, target):
        return self.decoder(target[:, :-1], *self.encoder(src))


class TinyKeyedSeq2Seq(nn.Module):
    """An encoder-decoder called by keywords, as the `Seq2Seq` of CodeBERT's code-to-text
    scripts (copied across CodeXGLUE, GraphCodeBERT, UniXcoder): `forward(source_ids,
    source_mask, target_ids, target_mask) -> (loss, loss * count, count)`, the mean
    cross-entropy of each target after the first where `target_mask` is set, over `count`
    such targets."""

    def __init__(self, vocab: int):
        super().__init__()
        self.pair = TinyPair(vocab)

    def forward(self, source_ids, source_mask=None, target_ids=None, target_mask=None, **options):
        log_probs = self.pair(source_ids, target_ids).flatten(0, 1).float()
        active = target_mask[:, 1:].ne(0).flatten()
        loss = F.nll_loss(log_probs[active], target_ids[:, 1:].flatten()[active])
        count = active.sum()
        return loss, loss * count, count


class TinySequenceModel(nn.Module):
    """A model that takes the token sequence and scores it itself, as lucidrains' models do:
    `forward(seq (B, T + 1), return_loss=True) -> loss`, the mean cross-entropy of each next
    token over the positions that are not padding (PAD_ID), whatever else it is handed
    (DialoGPT's position and type ids); logits (B, T, vocab) with `return_loss=False`. Position-wise, so padding does not change the other positions. `returns`:
    how the loop unpacks the loss (`loss, (ce, aux) = model(...)`, as nested tuples of None):
    the loss first, zeros in the other places. With `return_count=True` (what `gaaudit fix`
    asks of a project's model it also rewrites), the loss and its count of targets."""

    def __init__(self, vocab: int, returns: tuple | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.out = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, vocab))
        self.returns = returns

    def forward(self, seq=None, *others, return_loss: bool = True, **options):
        if seq is None:  # handed by keyword, `model(**batch)`: the batch's token ids, by
            # any name that says them (`model(**{"source_ids": batch[0], ...})`)
            seq = next((v for k, v in options.items() if BATCH_KEYS.get(k) == "input_ids"), None)
        elif isinstance(seq, dict):  # the whole batch, `model(data, mode=mode)`: its token ids
            seq = seq["input_ids"]
        logits = self.out(self.embed(seq[:, :-1]))
        if not return_loss:
            return logits
        targets = seq[:, 1:].flatten()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets, ignore_index=PAD_ID)
        if options.get("return_count"):
            return _counted(loss, (targets != PAD_ID).sum(), self.returns)
        return as_unpacked(loss, self.returns)


class TinyFrameModel(nn.Module):
    """A model that takes a spectrogram and scores it itself, as text-to-speech models (E2,
    F5) do: `forward(frames (B, N, CHANNELS), *others, lens=(B,)) -> loss`, the mean squared
    error of each frame's prediction of its own channels shifted by one, over the frames
    within `lens`, whatever else it is handed. Frame-wise, so padding does not change the other frames.
    `returns` and `return_count` as TinySequenceModel's."""

    def __init__(self, returns: tuple | None = None):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(CHANNELS, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CHANNELS))
        self.returns = returns

    def forward(self, frames, *others, lens=None, **options):
        errors = ((self.proj(frames) - frames.roll(1, -1)) ** 2).mean(-1).float()
        if lens is None:
            lens = torch.full(frames.shape[:1], frames.shape[1], device=frames.device)
        valid = torch.arange(frames.shape[1], device=frames.device) < lens[:, None]
        loss = errors[valid].mean()
        if options.get("return_count"):
            return _counted(loss, valid.sum(), self.returns)
        return as_unpacked(loss, self.returns)


class TinyMaskedAutoencoder(nn.Module):
    """A model that masks a share of each image's patches and scores its reconstruction of
    them itself, as MAE's: `forward(images (B, 3, H, W), *others, **options) -> loss`, the
    mean squared error of each masked patch's reconstruction over the masked patches. It masks
    MASKED of every image's PATCH x PATCH patches (whatever ratio it is handed), those of the
    largest mean, so that an image's mask does not depend on its micro-batch: the count
    follows the number of images. `returns` as TinySequenceModel's (MAE's `loss, _, _`)."""

    def __init__(self, returns: tuple | None = None):
        super().__init__()
        size = IMAGE_SHAPE[0] * PATCH * PATCH
        self.encode = nn.Linear(size, WIDTH)
        self.decode = nn.Sequential(nn.Tanh(), nn.Linear(WIDTH, size))
        self.returns = returns

    def forward(self, images, *others, **options):
        patches = F.unfold(images, PATCH, stride=PATCH).transpose(1, 2)  # (B, L, C * P * P)
        ranks = patches.mean(-1).argsort(dim=1, descending=True)
        mask = torch.zeros(patches.shape[:2], device=images.device)
        mask.scatter_(1, ranks[:, :MASKED], 1.0)
        hidden = self.encode(patches * (1 - mask).unsqueeze(-1))
        context = hidden.sum(1, keepdim=True) / (1 - mask).sum(1)[:, None, None]
        predictions = self.decode(hidden + context)
        errors = ((predictions - patches) ** 2).mean(-1).float()
        loss = (errors * mask).sum() / mask.sum()
        return as_unpacked(loss, self.returns)


class Output(tuple):
    """What diffusers' models return: a tuple (`[0]`, `return_dict=False`) whose first item is
    also `.sample` (a denoiser's prediction), `.last_hidden_state` (a text encoder's states)
    and `.latent_dist` (an autoencoder's latents)."""

    sample = last_hidden_state = latent_dist = property(lambda self: self[0])


class TinyDenoiser(nn.Module):
    """A latent-diffusion denoiser and its text encoder in one module, as a loop calls them:
    `forward(token ids (B, T)) -> Output(states (B, T, WIDTH))` (`text_encoder(ids)[0]`), and
    `forward(noisy latents (B, C, H, W), timesteps (B,) or (), states, **conditions) ->
    Output(prediction (B, C, H, W))` (`unet(noisy, t, states).sample`), where states may also
    be token or class ids (EDM's `net(x, sigma, labels)`)."""

    def __init__(self, vocab: int):
        super().__init__()
        channels = IMAGE_SHAPE[0]
        self.embed = nn.Embedding(vocab, WIDTH)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.time = nn.Linear(1, channels)
        self.text = nn.Linear(WIDTH, channels)

    def forward(self, sample, timestep=None, encoder_hidden_states=None, *args, **conditions):
        if not sample.is_floating_point():  # token ids: the text encoder
            return Output((self.embed(sample),))
        t = torch.as_tensor(timestep, device=sample.device).float().reshape(-1, 1) / TIMESTEPS
        h = self.conv(sample) + self.time(t)[:, :, None, None]
        states = encoder_hidden_states
        if isinstance(states, torch.Tensor):  # token or class ids: through the text encoder
            states = (
                states if states.is_floating_point() else self.embed(states.reshape(len(h), -1))
            )
            h = h + self.text(states.mean(1))[:, :, None, None]
        return Output((h,))


class Latents:
    """The distribution an autoencoder encodes images to: here the images themselves."""

    def __init__(self, images: torch.Tensor):
        self.mean = images

    def sample(self, generator=None) -> torch.Tensor:
        return self.mean

    def mode(self) -> torch.Tensor:
        return self.mean


class IdentityAutoencoder(nn.Module):
    """A frozen stand-in for a latent-diffusion VAE: each image is its own latent
    (`vae.encode(x).latent_dist.sample()`), with diffusers' `config.scaling_factor` and
    `dtype`."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(scaling_factor=0.18215, shift_factor=0.0)
        self.dtype = torch.float32

    def encode(self, images: torch.Tensor, *args, **kwargs) -> Output:
        return Output((Latents(images),))

    def forward(self, images: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return images


class NoiseSchedule:
    """DDPM's linear noise schedule over TIMESTEPS steps, predicting the noise, as diffusers'
    `DDPMScheduler()` (`add_noise`, `get_velocity`, `config.num_train_timesteps`,
    `config.prediction_type`, `alphas_cumprod`)."""

    def __init__(self):
        self.config = SimpleNamespace(num_train_timesteps=TIMESTEPS, prediction_type="epsilon")
        self.alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, TIMESTEPS), 0)
        self.timesteps = torch.arange(TIMESTEPS).flip(0)

    def _scales(self, like: torch.Tensor, timesteps) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.alphas_cumprod.to(like.device)[torch.as_tensor(timesteps).to(like.device)]
        kept = kept.reshape(-1, *[1] * (like.dim() - 1)).to(like.dtype)
        return kept.sqrt(), (1 - kept).sqrt()

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps) -> torch.Tensor:
        signal, spread = self._scales(latents, timesteps)
        return signal * latents + spread * noise

    def get_velocity(self, latents: torch.Tensor, noise: torch.Tensor, timesteps) -> torch.Tensor:
        signal, spread = self._scales(latents, timesteps)
        return signal * noise - spread * latents


class GaussianDiffusion(NoiseSchedule):
    """openai's diffusion trainers' `diffusion.training_losses(model, x_start, t,
    model_kwargs)` on NoiseSchedule's noise: each sample's mean squared error of the model's
    prediction of the noise added at its timestep, as `{"loss": ..., "mse": ...}`."""

    num_timesteps = TIMESTEPS

    def training_losses(self, model, x_start, t, model_kwargs=None, noise=None) -> dict:
        noise = torch.randn_like(x_start) if noise is None else noise
        predicted = model(self.add_noise(x_start, noise, t), t, **(model_kwargs or {}))
        predicted = predicted[0] if isinstance(predicted, tuple) else predicted
        errors = ((noise - predicted) ** 2).flatten(1).mean(1)
        return {"loss": errors, "mse": errors}


def denoising_loss(net, images: torch.Tensor, labels=None) -> torch.Tensor:
    """EDM's loss of `net` on `images` (its weighting left out): each element's squared error
    of the net's denoising of the images plus noise at a log-normal level per image."""
    level = torch.randn([images.shape[0], *[1] * (images.dim() - 1)], device=images.device)
    sigma = (level * 1.2 - 1.2).exp()
    denoised = net(images + torch.randn_like(images) * sigma, sigma, labels)
    denoised = denoised[0] if isinstance(denoised, tuple) else denoised
    return (denoised - images) ** 2


class TimestepSampler:
    """openai's diffusion trainers' `schedule_sampler.sample(batch_size, device)`: a uniform
    timestep for each sample and its weight, 1, on the replay's device (whatever device the
    loop names)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sample(self, batch_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        timesteps = torch.randint(0, TIMESTEPS, (batch_size,), device=self.device)
        return timesteps, torch.ones(batch_size, device=self.device)


@functools.cache
def lenient(cls: type) -> type:
    """`cls` whose missing `..._loss` attributes read as zero (`res.aux_loss` of a
    mixture-of-experts model, `breakdown.recon_loss`): a term the tiny model does not have.
    A tensor of it computes plain tensors."""

    def __getattr__(self, name: str):
        if name.endswith("_loss"):
            return torch.zeros(())
        raise AttributeError(f"'{cls.__name__}' object has no attribute '{name}'")

    body = {"__getattr__": __getattr__}
    if issubclass(cls, torch.Tensor):
        body["__torch_function__"] = torch._C._disabled_torch_function_impl
    return type(cls.__name__, (cls,), body)


def as_unpacked(loss: torch.Tensor, returns: tuple | None):
    """`loss` (or logits) in the shape the loop unpacks (nested tuples of None): it first,
    zeros in the other places (a breakdown of the loss: its `..._loss` terms read as zero
    too), and no entries in a mapping (`dict`) of further losses."""

    def shaped(part, first: bool):
        if part is dict:
            return {}
        if part is None:
            return loss if first else loss.new_zeros(()).as_subclass(lenient(torch.Tensor))
        return tuple(shaped(p, first and not i) for i, p in enumerate(part))

    return shaped(returns, True)


def _counted(loss: torch.Tensor, count: torch.Tensor, returns: tuple | None) -> tuple:
    """What a model asked for its count returns: what it returned, then the count (`loss,
    cond, pred, count = model(..., return_count=True)`, as `gaaudit fix` rewrites the call)."""
    if returns is None or len(returns) < 2:
        return loss, count
    return (*as_unpacked(loss, returns[:-1]), count)


def build_net(kind: str, vocab: int, returns: tuple | None = None) -> nn.Module:
    """A fresh model of one of NET_KINDS (seed the generator first); `returns`: see
    TinySequenceModel."""
    if kind == "image":
        return TinyImageClassifier()
    if kind == "segment":
        return TinySegmenter()
    if kind == "regression":
        return TinyRegressor()
    if kind == "sequence":
        return TinySequenceModel(vocab, returns)
    if kind == "frames":
        return TinyFrameModel(returns)
    if kind == "masked":
        return TinyMaskedAutoencoder(returns)
    if kind == "keyed":
        return TinyKeyedSeq2Seq(vocab)
    if kind == "latent":
        return TinyDenoiser(vocab)
    return TinyPair(vocab)


def output_width(kind: str, vocab: int) -> int:
    """The size of the model's last output dimension (classes, targets or vocabulary)."""
    return {"image": CLASSES, "segment": CLASSES, "regression": TARGETS}.get(kind, vocab)


def net_loss(
    kind: str, model: nn.Module, batch: dict, ignore_index: int, label_smoothing: float = 0.0
) -> torch.Tensor:
    """The mean loss over every counted target of `batch` (see net_count); NOISED_KINDS have
    none but the loop's."""
    if kind in NOISED_KINDS:
        raise ValueError(f"the {kind} kind's loss is the loop's own: it draws the noise")
    inputs, labels = batch["input_ids"], batch["labels"]
    if kind == "regression":
        return F.mse_loss(model(inputs).float(), labels)
    if kind == "sequence":
        return model(inputs, return_loss=True)
    if kind == "frames":  # channels first, as a spectrogram batch holds them
        return model(inputs.transpose(1, 2), lens=labels, return_count=True)[0]
    if kind == "masked":
        return model(inputs)
    if kind == "keyed":
        mask = (labels != ignore_index).long()
        return model(source_ids=inputs, target_ids=labels, target_mask=mask)[0]
    if kind == "pair":
        log_probs = model(inputs, labels)
        return F.nll_loss(
            log_probs.flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=ignore_index
        )
    return F.cross_entropy(
        model(inputs).float(), labels, ignore_index=ignore_index, label_smoothing=label_smoothing
    )


def net_count(kind: str, batch: dict, ignore_index: int) -> torch.Tensor:
    """The number of counted targets: every regression target, every frame within a
    spectrogram's length, the masked patches of each image, the targets of the pair after the
    first position, else the labels that are not `ignore_index`; every element of the latents
    of a latent-diffusion batch."""
    if kind == "latent":
        return torch.tensor(batch["pixel_values"].numel())
    if kind == "masked":
        return torch.tensor(len(batch["input_ids"]) * MASKED)
    labels = batch["labels"]
    if kind == "regression":
        return torch.tensor(labels.numel())
    if kind == "frames":  # each spectrogram's length
        return labels.sum()
    return ((labels[:, 1:] if kind in PADDED_KINDS else labels) != ignore_index).sum()


def net_record(kind: str, gen: torch.Generator, length, tokens, ignore_index: int) -> dict:
    """One sample: `length()` draws a sequence length, `tokens(n)` n token ids."""
    if kind == "latent":  # an image and its caption's tokens
        return {
            "pixel_values": torch.randn(IMAGE_SHAPE, generator=gen),
            "input_ids": tokens(PROMPT),
        }
    if kind == "regression":
        return {
            "input_ids": torch.randn(FEATURES, generator=gen),
            "labels": torch.randn(TARGETS, generator=gen),
        }
    if kind in ("pair", "keyed"):
        return {"input_ids": tokens(length()), "labels": tokens(length() + 1)}
    if kind == "sequence":  # the model shifts the sequence itself
        seq = tokens(length() + 1)
        return {"input_ids": seq, "labels": seq.clone()}
    if kind == "frames":  # a spectrogram, channels first, and its length
        frames = length()
        return {
            "input_ids": torch.randn(CHANNELS, frames, generator=gen),
            "labels": torch.tensor(frames),
        }
    image = torch.randn(IMAGE_SHAPE, generator=gen)
    if kind in ("image", "masked"):  # an image and its class
        return {"input_ids": image, "labels": torch.randint(CLASSES, (), generator=gen)}
    pixels = torch.randint(CLASSES, IMAGE_SHAPE[1:], generator=gen)
    kept = float(torch.empty(()).uniform_(0.2, 1.0, generator=gen))
    void = torch.rand(IMAGE_SHAPE[1:], generator=gen) > kept
    void.view(-1)[0] = False  # at least one counted pixel
    return {"input_ids": image, "labels": pixels.masked_fill(void, ignore_index)}
