"""`vlm_judge`: a reward (or an evaluation judge) asked of a vision-language model behind an OpenAI-compatible API.

Any server with `/v1/chat/completions` will do: vLLM, SGLang, or a hosted API.
Each image (or K evenly spaced frames of each video) goes as a PNG data URL in
one chat request per sample, with the prompt filled into the mode's template.
Three ways to read a score from the reply:

- `yes_no`: one token with `top_logprobs`; score = sigmoid(lp(Yes) - lp(No)),
  each side the logsumexp of its case and spacing variants ("Yes", " yes",
  "YES"). A side missing from the top list is bounded from above (see
  `yes_no_score`); both missing is unparsable.
- `score`: a regex finds a number in a rubric reply (UnifiedReward's
  "Final Score: x" of 1-5) and maps `score_range` onto [0, 1].
- `json`: the reply is (or holds) `{"score": x}`, mapped the same way.

Failure is never a score: a sample whose calls all failed (connection, timeout,
5xx, 429), whose reply did not parse, or which the batch's `budget_s` left
unanswered is NaN, which the RewardSet masks and counts (reward/vlm_judge/invalid);
`counts` keeps the totals by reason. Bounds are wall clock, as for `remote:`:
`timeout_s` per call, `budget_s` per batch, retries with exponential backoff
inside the budget, at most `max_concurrency` calls in flight.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import io
import json
import logging
import math
import os
import re
import time

import torch

from rewards.remote import check_seconds
from rewards.video import check_frames, sample_frames

log = logging.getLogger(__name__)

URL_ENV = "FLYWHEEL_VLM_URL"
MODEL_ENV = "FLYWHEEL_VLM_MODEL"
KEY_ENV = "OPENAI_API_KEY"
MODES = ("yes_no", "score", "json")

# `{prompt}` is the generation prompt. The yes_no template must invite a one-word answer.
TEMPLATES = {
    "yes_no": 'Does this image show "{prompt}"? Answer with one word: Yes or No.',
    "score": ('You are an expert judge of generated images. Rate how well this image matches the description '
              '"{prompt}" and how good it looks, from 1 (poor) to 5 (excellent). Explain briefly, then end with '
              'a line "Final Score: x".'),
    "json": ('Rate how well this image matches the description "{prompt}" on a scale from 0 to 10. Reply with '
             'JSON only, in the form {{"score": x}}.'),
}
# With `source_image=True` (editing): the source goes first, the edit second, and `{prompt}` is the instruction.
EDIT_TEMPLATES = {
    "yes_no": ('The first image is an original, the second an edit of it. Does the edit carry out the instruction '
               '"{prompt}" and keep the rest of the original? Answer with one word: Yes or No.'),
    "score": ('You are an expert judge of image edits. The first image is the original, the second the edit. Rate '
              'how well the edit carries out the instruction "{prompt}" while keeping what the instruction does not '
              'change, from 1 (poor) to 5 (excellent). Explain briefly, then end with a line "Final Score: x".'),
    "json": ('The first image is an original, the second an edit of it. Rate how well the edit carries out the '
             'instruction "{prompt}" while keeping the rest, on a scale from 0 to 10. Reply with JSON only, in the '
             'form {{"score": x}}.'),
}
RANGES = {"score": (1.0, 5.0), "json": (0.0, 10.0)}
# The number must end there: "Final Score: 1e3" or "4.5.6" is no score (a bare \d+ would read 1 and 4.5).
SCORE_PATTERN = r"Final Score:\s*\**\s*([-+]?\d+(?:\.\d+)?)(?!\d|\.\d|[eE][-+]?\d)"
_JSON_OBJECT = re.compile(r"\{.*?\}", re.S)


LOGPROB_SLACK = 1e-4  # rounding room above 0 for a server's log-probabilities


class Unparsable(ValueError):
    """The server answered, but the reply holds no score in the mode's format."""


def data_url(image: torch.Tensor) -> str:
    """An image [C, H, W] in [0, 1] (C = 1 or 3) as a PNG data URL (uint8, grey repeated to RGB)."""
    from PIL import Image

    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"expected an image [C, H, W] with C in (1, 3), got {tuple(image.shape)}")
    x = torch.nan_to_num(image.detach().to("cpu", torch.float32), nan=0.0).clamp(0, 1)
    x = (x.expand(3, -1, -1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(x, "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _fold(token: str) -> str:
    """A token as the answer word it spells: "Yes", " yes", "YES." -> "yes"."""
    return token.strip().strip(".,!:;\"'").lower()


def yes_no_score(top_logprobs: list[tuple[str, float]]) -> float:
    """sigmoid(lp(Yes) - lp(No)) from one position's top log-probs [(token, logprob), ...].

    Each side is the logsumexp of the tokens that fold to it. A side absent from the
    list has a log-prob at most that of the least likely listed token and at most
    log(1 - listed mass); the smaller bound stands in for it, so the score errs toward
    the uncertain middle, never past what the server said. Neither side listed:
    Unparsable (the model did not answer the question).
    """
    if not top_logprobs:
        raise Unparsable("the reply has no top_logprobs (does the server support logprobs?)")
    positive = [(t, lp) for t, lp in top_logprobs if lp > LOGPROB_SLACK]
    if positive:  # a log-probability is <= 0; read as one, it would be a confident score
        raise Unparsable(f"the reply's top_logprobs hold positive values {positive[:3]}, which are no "
                         f"log-probabilities")
    sides: dict[str, list[float]] = {"yes": [], "no": []}
    for token, logprob in top_logprobs:
        if _fold(token) in sides and math.isfinite(logprob):
            sides[_fold(token)].append(logprob)
    if not sides["yes"] and not sides["no"]:
        raise Unparsable(f"neither Yes nor No among the top tokens {[t for t, _ in top_logprobs[:6]]}")
    finite = [lp for _, lp in top_logprobs if math.isfinite(lp)]
    listed = torch.logsumexp(torch.tensor(finite, dtype=torch.float64), 0).item()
    rest = math.log(-math.expm1(listed)) if listed < 0 else -math.inf  # log(1 - listed mass)
    bound = min(min(finite), rest)
    lp = {side: torch.logsumexp(torch.tensor(v, dtype=torch.float64), 0).item() if v else bound
          for side, v in sides.items()}
    if lp["no"] == -math.inf:
        return 1.0
    if lp["yes"] == -math.inf:
        return 0.0
    return 1.0 / (1.0 + math.exp(lp["no"] - lp["yes"]))


def range_score(value: float, score_range: tuple[float, float]) -> float:
    """`value` mapped from `score_range` onto [0, 1]; Unparsable when outside the range (not the rubric's)."""
    low, high = score_range
    if not math.isfinite(value) or not low <= value <= high:
        raise Unparsable(f"score {value!r} is outside the rubric's range [{low:g}, {high:g}]")
    return (value - low) / (high - low)


def rubric_score(text: str, pattern: re.Pattern, score_range: tuple[float, float]) -> float:
    """The last number `pattern` captures in a rubric reply, mapped onto [0, 1]."""
    found = pattern.findall(text or "")
    if not found:
        raise Unparsable(f"no match of {pattern.pattern!r} in the reply {(text or '')[-200:]!r}")
    last = found[-1]
    return range_score(float(last[0] if isinstance(last, tuple) else last), score_range)


def json_score(text: str, score_range: tuple[float, float]) -> float:
    """The "score" of a JSON object reply (bare, or inside a fenced block), mapped onto [0, 1]."""
    candidates = [text or ""] + _JSON_OBJECT.findall(text or "")
    for candidate in candidates:
        try:
            obj = json.loads(candidate.strip())
        except ValueError:
            continue
        if isinstance(obj, dict) and "score" in obj:
            value = obj["score"]
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise Unparsable(f'"score" is {value!r}, not a number')
            try:
                return range_score(float(value), score_range)
            except ValueError as exc:
                raise Unparsable(str(exc)) from None
    raise Unparsable(f'no JSON object with a "score" in the reply {(text or "")[:200]!r}')


class VlmJudge:
    """Scorer: a VLM's verdict on each image (or video), in [0, 1], over an OpenAI-compatible API."""

    name = "vlm_judge"
    output_range = (0.0, 1.0)  # every mode maps its reply onto [0, 1]

    def __init__(self, base_url: str | None = None, model: str | None = None, mode: str = "yes_no",
                 prompt: str | None = None, system: str | None = None,
                 score_range: tuple[float, float] | list[float] | None = None, score_pattern: str = SCORE_PATTERN,
                 api_key_env: str = KEY_ENV, video_frames: int | None = None, max_concurrency: int = 16,
                 timeout_s: float = 60.0, budget_s: float = 300.0, retries: int = 2, backoff_s: float = 0.5,
                 top_logprobs: int = 20, max_tokens: int | None = None, temperature: float = 0.0,
                 image_size: int | None = None, source_image: bool = False):
        """`base_url`: the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (default ${URL_ENV});
        `model`: the served model's name (default ${MODEL_ENV}, else the server's first listed model);
        `prompt`: the mode's template with `{prompt}` (default TEMPLATES[mode]); `system`: a system message;
        `score_range`: the (low, high) of the score/json modes' number (default 1-5 / 0-10);
        `api_key_env`: the environment variable holding the API key (servers without keys accept any);
        `video_frames`: K, to judge videos by K evenly spaced frames in one request (declares wants_video);
        `image_size`: resize each image so its shorter side has this many pixels (VLMs need ~28 or more);
        `source_image`: judge an edit: each row's source image (metadata["image"], a path) is sent before the
        output, and the default template asks whether the edit follows the instruction (EDIT_TEMPLATES)."""
        if mode not in MODES:
            raise ValueError(f"vlm_judge mode {mode!r} is not known; valid modes: {', '.join(MODES)}")
        self.mode = mode
        self.base_url = (base_url or os.environ.get(URL_ENV) or "").rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"vlm_judge needs the server's base URL, e.g. http://127.0.0.1:8000/v1: pass "
                             f"base_url=... or set {URL_ENV} (got {self.base_url or 'nothing'!r})")
        if not isinstance(source_image, bool):
            raise ValueError(f"vlm_judge source_image must be true or false, got {source_image!r}")
        self.source_image = source_image
        self.template = (EDIT_TEMPLATES if source_image else TEMPLATES)[mode] if prompt is None else prompt
        try:
            self.template.format(prompt="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"vlm_judge prompt template {self.template!r} is not valid: it may use only "
                             f"{{prompt}} (write literal braces as {{{{ }}}}): {exc!r}") from None
        self.system = system
        low, high = RANGES.get(mode, (0.0, 1.0)) if score_range is None else tuple(score_range)
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"vlm_judge score_range must be two finite numbers low < high, got {score_range!r}")
        self.score_range = (float(low), float(high))
        try:
            self.pattern = re.compile(score_pattern)
        except re.error as exc:
            raise ValueError(f"vlm_judge score_pattern {score_pattern!r} is not a valid regex: {exc}") from None
        for key, value, least in (("max_concurrency", max_concurrency, 1), ("retries", retries, 0),
                                  ("top_logprobs", top_logprobs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"vlm_judge {key} must be an integer >= {least}, got {value!r}")
        if mode == "yes_no" and top_logprobs < 20:
            raise ValueError(f"vlm_judge top_logprobs={top_logprobs}: yes_no needs >= 20 so that both answers "
                             "are usually listed (vLLM allows up to 20 by default)")
        if isinstance(backoff_s, bool) or not (isinstance(backoff_s, (int, float)) and 0 <= backoff_s < math.inf):
            raise ValueError(f"vlm_judge backoff_s must be a finite number of seconds >= 0, got {backoff_s!r}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError(f"vlm_judge max_tokens must be an integer >= 1 or null (the mode's default), got "
                             f"{max_tokens!r}")
        if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
            raise ValueError(f"vlm_judge temperature must be a finite number >= 0, got {temperature!r}")
        self.timeout_s, self.budget_s = check_seconds("timeout_s", timeout_s), check_seconds("budget_s", budget_s)
        self.max_concurrency, self.retries, self.backoff_s = max_concurrency, retries, float(backoff_s)
        self.top_logprobs, self.temperature = top_logprobs, float(temperature)
        self.max_tokens = max_tokens if max_tokens is not None else {"yes_no": 1, "score": 512, "json": 64}[mode]
        self.video_frames = None if video_frames is None else check_frames(video_frames, "video_frames")
        self.wants_video = self.video_frames is not None
        if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int)
                                       or image_size < 1):
            raise ValueError(f"vlm_judge image_size must be a positive integer or null, got {image_size!r}")
        self.image_size = image_size
        self.api_key = os.environ.get(api_key_env) or "EMPTY"  # vLLM and SGLang without --api-key take any
        self.counts: collections.Counter = collections.Counter()  # rows scored / masked, by reason, all batches
        self.model = model or os.environ.get(MODEL_ENV) or self._first_model()

    @classmethod
    def check_args(cls, **kwargs) -> None:
        """Every check the constructor makes of its arguments, without asking the server for its model
        (`rewards.registry.check_scorer`: before a training run writes its directory)."""
        probe = cls.__new__(cls)
        probe._first_model = lambda: ""  # shadows the method on this instance only: no request is made
        cls.__init__(probe, **kwargs)

    def _client(self):
        from openai import AsyncOpenAI

        # Retries and time bounds are ours (wall clock, inside the batch budget), not the client's.
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=self.timeout_s)

    def _first_model(self) -> str:
        """The first model the server lists (vLLM and SGLang serve one); a clear error if none answers."""
        async def first() -> str:
            async with self._client() as client:
                page = await asyncio.wait_for(client.models.list(), self.timeout_s)
                return page.data[0].id

        try:
            return _run(first())
        except Exception as exc:
            raise RuntimeError(f"vlm_judge could not list the models of {self.base_url} ({type(exc).__name__}: "
                               f"{exc}); pass model=... or set {MODEL_ENV}") from None

    def _images(self, images: torch.Tensor, videos: torch.Tensor | None) -> list[list[torch.Tensor]]:
        """Per sample, the images sent: the one image, or K frames of its video."""
        if self.wants_video:
            frames = sample_frames(videos, self.video_frames)
            per_sample = [list(f) for f in frames]
        else:
            if images.dim() != 4:
                raise ValueError(f"vlm_judge expects images [B, C, H, W], got {tuple(images.shape)}; for videos "
                                 "set video_frames=K")
            per_sample = [[im] for im in images]
        return self._resized(per_sample)

    def _resized(self, per_sample: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Each image with its shorter side at `image_size` pixels (unchanged when it is None)."""
        if self.image_size is not None:
            import torch.nn.functional as F

            def resize(im: torch.Tensor) -> torch.Tensor:
                h, w = im.shape[-2:]
                scale = self.image_size / min(h, w)
                size = (max(1, round(h * scale)), max(1, round(w * scale)))
                return F.interpolate(im[None].float(), size=size, mode="bilinear", align_corners=False)[0]

            per_sample = [[resize(im) for im in ims] for ims in per_sample]
        return per_sample

    def messages(self, prompt: str, images: list[torch.Tensor]) -> list[dict]:
        """The chat messages of one sample: the optional system message, then the images and the filled template."""
        content = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
        content.append({"type": "text", "text": self.template.format(prompt=prompt)})
        out = [{"role": "system", "content": self.system}] if self.system else []
        return out + [{"role": "user", "content": content}]

    def parse(self, choice) -> float:
        """The score in [0, 1] of one reply choice; Unparsable when it holds none."""
        if self.mode == "yes_no":
            content = getattr(getattr(choice, "logprobs", None), "content", None)
            if not content:
                raise Unparsable("the reply has no logprobs (the server must support logprobs=true)")
            return yes_no_score([(t.token, t.logprob) for t in (content[0].top_logprobs or [])])
        text = choice.message.content
        if self.mode == "score":
            return rubric_score(text, self.pattern, self.score_range)
        return json_score(text, self.score_range)

    async def _ask(self, client, semaphore: asyncio.Semaphore, messages: list[dict], deadline: float) -> float:
        """One sample's score: the call retried with backoff while the batch's budget lasts; raises on failure."""
        from openai import APIConnectionError, APIStatusError, APITimeoutError

        kwargs = dict(model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature)
        if self.mode == "yes_no":
            kwargs.update(logprobs=True, top_logprobs=self.top_logprobs)
        last: Exception = TimeoutError("no attempt made within budget_s")
        for attempt in range(self.retries + 1):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1)
                if time.monotonic() + pause >= deadline:
                    break
                await asyncio.sleep(pause)
            async with semaphore:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    reply = await asyncio.wait_for(client.chat.completions.create(**kwargs),
                                                   min(self.timeout_s, left))
                except (asyncio.TimeoutError, APITimeoutError) as exc:
                    last = TimeoutError(f"no reply within timeout_s={self.timeout_s:g}") if not str(exc) else exc
                    continue
                except APIConnectionError as exc:
                    last = exc
                    continue
                except APIStatusError as exc:
                    last = exc
                    if exc.status_code == 429 or exc.status_code >= 500:
                        continue
                    raise  # a refused request (4xx) is refused again
            if not reply.choices:
                raise Unparsable("the reply has no choices")
            return self.parse(reply.choices[0])
        raise last

    async def _score_all(self, samples: list[list[dict]]) -> list[float | BaseException]:
        deadline = time.monotonic() + self.budget_s
        semaphore = asyncio.Semaphore(self.max_concurrency)
        async with self._client() as client:
            tasks = [asyncio.ensure_future(self._ask(client, semaphore, m, deadline)) for m in samples]
            done, pending = await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0.0))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return [t.result() if t in done and t.exception() is None else
                (t.exception() if t in done else TimeoutError(f"unanswered within budget_s={self.budget_s:g}"))
                for t in tasks]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], *,
                 videos: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [B] float32 in [0, 1] on the host; NaN for a sample with no score (failed or unparsable)."""
        per_sample = self._images(images, videos)
        if self.source_image:
            from rewards.edit import read_image, source_paths

            sources = self._resized([[read_image(p, "vlm_judge")[0]] for p in source_paths(metadata, "vlm_judge")])
            per_sample = [src + ims for src, ims in zip(sources, per_sample)]
        samples = [self.messages(p, ims) for p, ims in zip(prompts, per_sample)]
        results = _run(self._score_all(samples))
        scores = torch.full((len(samples),), math.nan)
        reasons: collections.Counter = collections.Counter()
        first_error = None
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                reason = "unparsable" if isinstance(result, Unparsable) else type(result).__name__
                reasons[reason] += 1
                first_error = first_error or f"{reason}: {result}"
            else:
                scores[i] = result
        self.counts["scored"] += len(samples) - sum(reasons.values())
        self.counts.update(reasons)
        if reasons:
            log.warning("vlm_judge at %s masked %d of %d samples (%s); first: %s", self.base_url,
                        sum(reasons.values()), len(samples), dict(reasons), first_error[:300])
        return scores


def _run(coroutine):
    """Run a coroutine to completion from synchronous code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a loop is running here: use a fresh thread
        return pool.submit(asyncio.run, coroutine).result()
