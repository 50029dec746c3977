"""Built-in audio rewards that need no model download: loudness on target, and audio-video onset sync.

Both read the rollouts' audio [B, channels, samples] in [-1, 1] (see the
`wants_audio` declaration in rewards.types); `av_onset_sync` also reads the
whole videos [B, C, F, H, W]. Levels are in dBFS relative to a full-scale
square wave (RMS 1): a full-scale sine is -3.01 dBFS. Channels are pooled by
energy (mean of squares), never averaged as signals, so two channels in
opposite phase do not cancel into silence.
"""

from __future__ import annotations

import math

import torch


def _levels_db(mean_square: torch.Tensor, floor_db: float) -> torch.Tensor:
    """10·log10 of mean squares (the dBFS of their RMS), floored at `floor_db` so that silence is finite."""
    return 10.0 * torch.log10(mean_square.clamp_min(10.0 ** (floor_db / 10.0)))


class AudioLoudness:
    """How close each clip's loudness is to a target, minus a penalty for the silent part of the clip.

    score = -|L - target_db| / db_per_point - silence_weight · (fraction of silent windows)

    L is the RMS level of the whole clip in dBFS (all channels); a window is
    silent when its own RMS level is below `silence_db`. 0 is the best score.
    The penalty is linear in dB, not a bell around the target, so a silent or
    very quiet rollout still gets a slope towards the target (a Gaussian score
    would be flat there and give GRPO equal rewards, hence no advantage). The
    silence term catches the clip that reaches the target loudness with one loud
    burst and silence elsewhere.
    """

    name = "audio_loudness"
    wants_audio = True

    def __init__(self, target_db: float = -20.0, db_per_point: float = 10.0, silence_db: float = -60.0,
                 window_s: float = 0.05, silence_weight: float = 1.0, floor_db: float = -100.0):
        """`target_db`: the loudness to reach (dBFS); `db_per_point`: dB of error that cost 1 point;
        `silence_db`: level under which a `window_s`-second window counts as silent; `silence_weight`: the
        points a wholly silent clip loses on top; `floor_db`: the level digital silence is taken to have."""
        for key, value in (("target_db", target_db), ("silence_db", silence_db), ("floor_db", floor_db)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value <= 0):
                raise ValueError(f"{key} must be a finite level in dBFS <= 0, got {value!r}")
        for key, value in (("db_per_point", db_per_point), ("window_s", window_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
        if not (isinstance(silence_weight, (int, float)) and math.isfinite(silence_weight) and silence_weight >= 0):
            raise ValueError(f"silence_weight must be a finite number >= 0, got {silence_weight!r}")
        if floor_db >= silence_db:
            raise ValueError(f"floor_db ({floor_db}) must be below silence_db ({silence_db}): the floor is the "
                             "level of digital silence")
        self.target_db, self.db_per_point, self.silence_db = float(target_db), float(db_per_point), float(silence_db)
        self.window_s, self.silence_weight, self.floor_db = float(window_s), float(silence_weight), float(floor_db)

    def loudness_db(self, audio: torch.Tensor) -> torch.Tensor:
        """The RMS level of each clip in dBFS, [B] float64."""
        return _levels_db(audio.double().pow(2).mean(dim=(1, 2)), self.floor_db)

    def silent_fraction(self, audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
        """The fraction of each clip's `window_s` windows whose level is below `silence_db`, [B] float64.

        Whole windows only (a trailing part shorter than a window is left out), unless the clip is
        shorter than one window: then the clip is its only window.
        """
        samples = audio.shape[-1]
        width = min(max(1, round(self.window_s * sample_rate)), samples)
        count = samples // width
        windows = audio[..., :count * width].double().reshape(*audio.shape[:2], count, width)
        levels = _levels_db(windows.pow(2).mean(dim=(1, 3)), self.floor_db)  # [B, count]
        silent = (levels < self.silence_db).double()
        # A NaN sample makes its row NaN rather than "not silent": the combiner masks it.
        return torch.where(torch.isnan(levels).any(dim=1), torch.full_like(silent[:, 0], math.nan),
                           silent.mean(dim=1))

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], *,
                 audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
        off_target = (self.loudness_db(audio) - self.target_db).abs() / self.db_per_point
        score = -off_target - self.silence_weight * self.silent_fraction(audio, sample_rate)
        return score.float().cpu()


class AvOnsetSync:
    """Whether sounds start when the picture changes: correlation of audio onsets with video motion.

    Both signals are brought to the video's frame rate: the audio is cut into F
    spans, one per frame (the clip and the video are taken to cover the same
    time, as a joint audio-video model generates them), and each span's RMS
    gives an energy envelope E; the onset envelope is its rise,
    max(E_k - E_{k-1}, 0), and the motion envelope the mean absolute difference
    between frames k-1 and k (k = 1..F-1). The score is their Pearson
    correlation in [-1, 1], the best over lags of up to `max_lag_frames` frames
    either way (people do not notice an offset of about a frame; ITU-R BT.1359
    puts detectability at +45 ms audio early / -125 ms late).

    Linear RMS, not a log level, in the envelope: in the log domain the noise
    floor of a silent stretch swings by tens of dB and would read as onsets.
    A row with no onsets or no motion (an envelope whose std is under
    `min_onset` times the clip's loudest span, or under `min_motion`) scores 0:
    there is nothing to align, which is neither sync nor its opposite.
    """

    name = "av_onset_sync"
    wants_audio = True
    wants_video = True

    def __init__(self, max_lag_frames: int = 1, min_onset: float = 1e-3, min_motion: float = 1e-4):
        """`max_lag_frames`: the largest offset (in frames, either way) forgiven; `min_onset`: the onset std,
        relative to the loudest frame span's RMS, below which a clip has no onsets; `min_motion`: the motion
        std (pixel units in [0, 1]; one uint8 step is 0.0039) below which a video does not move."""
        if isinstance(max_lag_frames, bool) or not isinstance(max_lag_frames, int) or max_lag_frames < 0:
            raise ValueError(f"max_lag_frames must be an integer >= 0, got {max_lag_frames!r}")
        for key, value in (("min_onset", min_onset), ("min_motion", min_motion)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
        self.max_lag_frames, self.min_onset, self.min_motion = max_lag_frames, float(min_onset), float(min_motion)

    @staticmethod
    def frame_energy(audio: torch.Tensor, frames: int) -> torch.Tensor:
        """The RMS of the audio span under each of `frames` video frames, [B, frames] float64.

        Sample n belongs to frame floor(n·frames / samples), so the spans tile the clip exactly even
        when the samples do not divide evenly.
        """
        samples = audio.shape[-1]
        if samples < frames:
            raise ValueError(f"audio of {samples} samples is shorter than the video's {frames} frames; "
                             "av_onset_sync needs at least one sample per frame")
        owner = torch.arange(samples, device=audio.device) * frames // samples
        power = audio.double().pow(2).mean(dim=1)  # [B, samples], channels pooled by energy
        sums = torch.zeros(audio.shape[0], frames, dtype=torch.float64, device=audio.device).index_add_(1, owner, power)
        counts = torch.bincount(owner, minlength=frames).to(torch.float64)
        return (sums / counts).sqrt()

    @staticmethod
    def motion(videos: torch.Tensor) -> torch.Tensor:
        """Mean absolute change from frame k-1 to frame k, [B, F-1] float64."""
        return (videos[:, :, 1:].double() - videos[:, :, :-1].double()).abs().mean(dim=(1, 3, 4))

    def envelopes(self, audio: torch.Tensor, videos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(onset [B, F-1], motion [B, F-1], loudest span RMS [B]) of a batch."""
        if videos.dim() != 5:
            raise ValueError(f"videos must be [B, C, F, H, W], got {tuple(videos.shape)}")
        frames = videos.shape[2]
        if frames < 3:
            raise ValueError(f"av_onset_sync needs videos of at least 3 frames (2 frame changes to correlate), "
                             f"got {frames}")
        energy = self.frame_energy(audio.to(videos.device), frames)
        onset = (energy[:, 1:] - energy[:, :-1]).clamp_min(0)
        return onset, self.motion(videos), energy.amax(dim=1)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], *,
                 audio: torch.Tensor, sample_rate: int, videos: torch.Tensor) -> torch.Tensor:
        onset, motion, peak = self.envelopes(audio, videos)
        changes = onset.shape[1]
        best = None
        for lag in range(-min(self.max_lag_frames, changes - 2), min(self.max_lag_frames, changes - 2) + 1):
            # lag > 0 pairs a video change with the onset `lag` frames later (sound late).
            a = onset[:, lag:] if lag >= 0 else onset[:, :lag]
            m = motion[:, :changes - lag] if lag >= 0 else motion[:, -lag:]
            r = _pearson(a, m, self.min_onset * peak, self.min_motion)
            best = r if best is None else torch.maximum(best, r)
        # Non-finite input: NaN, which the combiner masks (torch.maximum propagates it).
        bad = ~(torch.isfinite(audio).flatten(1).all(1).to(best.device) & torch.isfinite(videos).flatten(1).all(1))
        return torch.where(bad, torch.full_like(best, math.nan), best).float().cpu()


def _pearson(x: torch.Tensor, y: torch.Tensor, min_std_x: torch.Tensor, min_std_y: float) -> torch.Tensor:
    """Row-wise Pearson correlation of x and y [B, n]; 0 where either row's std is at or under its minimum."""
    xc, yc = x - x.mean(dim=1, keepdim=True), y - y.mean(dim=1, keepdim=True)
    sx, sy = xc.pow(2).mean(dim=1).sqrt(), yc.pow(2).mean(dim=1).sqrt()
    flat = (sx <= min_std_x) | (sy <= min_std_y)
    r = (xc * yc).mean(dim=1) / torch.where(flat, torch.ones_like(sx), sx * sy)
    return torch.where(flat, torch.zeros_like(r), r)
