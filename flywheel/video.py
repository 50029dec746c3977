"""Videos of video-model rollouts: MP4 files (with their sound), WAV files, frames for image scorers.

Rollouts of a video card decode to [B, C, F, H, W] in [0, 1], and a card that
makes sound adds audio [B, channels, samples] in [-1, 1] at a sample rate.
`write_mp4` muxes a clip's audio into its MP4 as AAC (imageio-ffmpeg's own
ffmpeg binary, so no system ffmpeg is needed); `write_wav` keeps the audio
alone as 16-bit PCM. `probe_media` and `read_audio` read a file back.

Image reward models take [B, C, H, W]; `MiddleFrameRewards` scores each
video's middle frame (the frame farthest from the causal VAE's first-frame
artefacts, and one scorer call per video rather than F), and hands the whole
videos to the scorers that ask for them (`wants_video`, see rewards.types).
"""

from __future__ import annotations

import logging
import re
import subprocess
import wave
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

# The sample rates an AAC stream can carry (MPEG-4 sampling frequency index); others are resampled to 48 kHz.
AAC_SAMPLE_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)
PCM_FULL_SCALE = 32767  # int16 value of +1.0: -1.0 and +1.0 both fit, and a round trip is within half a step


# Longest prompt slug in a sample file's name: long enough to tell prompts apart, short enough for any file system.
SLUG_MAX_CHARS = 48


def prompt_slug(prompt: str, max_chars: int = SLUG_MAX_CHARS) -> str:
    """A file-name-safe slug of a prompt: ASCII letters and digits joined by "-", at most `max_chars`.

    Accents are dropped to their letters (é -> e), everything else (slashes, dots, quotes, spaces) becomes
    one "-", a cut falls on a word boundary when there is one; "prompt" when nothing is left.
    """
    import unicodedata

    ascii_text = unicodedata.normalize("NFKD", prompt).encode("ascii", "ignore").decode().lower()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text).strip("-")
    if len(slug) > max_chars:
        cut = slug[:max_chars + 1]
        slug = cut.rsplit("-", 1)[0] if "-" in cut[1:] else slug[:max_chars]
        slug = slug[:max_chars].strip("-")
    return slug or "prompt"


def sample_file_name(step: int, index: int, prompt: str, suffix: str) -> str:
    """The name of an evaluation sample's file: `step-000020-03-a-red-cat.mp4` (step, the prompt's index, its
    slug), so files sort by step and then by prompt, and say which prompt they show."""
    return f"step-{step:06d}-{index:02d}-{prompt_slug(prompt)}{suffix}"


def is_video(x: torch.Tensor) -> bool:
    """True for a batch of videos [B, C, F, H, W]."""
    return x.dim() == 5


def middle_frame(videos: torch.Tensor) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, C, H, W], the frame at F // 2."""
    if not is_video(videos):
        raise ValueError(f"videos must have shape [B, C, F, H, W], got {tuple(videos.shape)}")
    return videos[:, :, videos.shape[2] // 2]


def video_to_uint8(video: torch.Tensor) -> np.ndarray:
    """One video [C, F, H, W] in [0, 1] to frames [F, H, W, 3] uint8 (grey is repeated to RGB)."""
    if video.dim() != 4:
        raise ValueError(f"a video must have shape [C, F, H, W], got {tuple(video.shape)}")
    x = torch.nan_to_num(video.detach().to("cpu", torch.float32), nan=0.0).clamp(0.0, 1.0)
    x = (x * 255.0).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
    if x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    return np.ascontiguousarray(x)


def audio_to_int16(audio: torch.Tensor) -> np.ndarray:
    """One clip [channels, samples] in [-1, 1] to interleaved int16 samples [samples, channels] (clipped)."""
    if audio.dim() != 2 or audio.shape[0] < 1 or audio.shape[1] < 1:
        raise ValueError(f"a clip of audio must have shape [channels, samples], got {tuple(audio.shape)}")
    x = torch.nan_to_num(audio.detach().to("cpu", torch.float64), nan=0.0).clamp(-1.0, 1.0)
    return np.ascontiguousarray((x * PCM_FULL_SCALE).round().to(torch.int16).T.numpy())


def write_wav(audio: torch.Tensor, sample_rate: int, path: str | Path) -> Path:
    """Write one clip [channels, samples] in [-1, 1] as a 16-bit PCM WAV file; returns the path."""
    pcm = audio_to_int16(audio)
    rate = _sample_rate(sample_rate)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".partial.wav")
    with wave.open(str(tmp), "wb") as out:
        out.setnchannels(pcm.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.astype("<i2").tobytes())
    tmp.replace(path)
    return path


def read_wav(path: str | Path) -> tuple[torch.Tensor, int]:
    """(audio [channels, samples] float32 in [-1, 1], sample rate) of a 16-bit PCM WAV file."""
    with wave.open(str(path), "rb") as f:
        if f.getsampwidth() != 2:
            raise ValueError(f"{path}: {8 * f.getsampwidth()}-bit samples; read_wav reads 16-bit PCM")
        channels, rate = f.getnchannels(), f.getframerate()
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, channels)
    return torch.from_numpy(pcm.T.astype(np.float32) / PCM_FULL_SCALE), rate


def _sample_rate(sample_rate: object) -> int:
    """A positive int sample rate, or a ValueError saying what came."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate < 1:
        raise ValueError(f"sample_rate must be a positive integer (Hz), got {sample_rate!r}")
    return int(sample_rate)


def write_mp4(video: torch.Tensor, path: str | Path, fps: int = 16, audio: torch.Tensor | None = None,
              sample_rate: int | None = None) -> Path:
    """Write one video [C, F, H, W] in [0, 1] as an H.264 MP4 (imageio + imageio-ffmpeg); returns the path.

    With `audio` [channels, samples] in [-1, 1] and its `sample_rate`, the clip is muxed in as an
    AAC track (at that rate when AAC has it, else resampled to 48 kHz). Neither stream is cut to the
    other's length; a warning says when they differ by more than a frame (usually a wrong `fps`).
    """
    import imageio.v2 as imageio

    frames = video_to_uint8(video)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".partial.mp4")
    sound: dict = {}
    wav = None
    if audio is not None:
        rate = _sample_rate(sample_rate)
        wav = write_wav(audio, rate, path.with_name(path.stem + ".audio.partial.wav"))
        video_s, audio_s = frames.shape[0] / fps, audio.shape[-1] / rate
        if abs(video_s - audio_s) > 1.0 / fps:
            log.warning("%s: the audio lasts %.3f s and the video %.3f s (%d frames at %g fps); is fps the "
                        "card's frame rate?", path.name, audio_s, video_s, frames.shape[0], fps)
        resample = [] if rate in AAC_SAMPLE_RATES else ["-ar", "48000"]
        sound = {"audio_path": str(wav), "audio_codec": "aac", "output_params": resample}
    elif sample_rate is not None:
        raise ValueError("write_mp4 got a sample_rate but no audio; pass both or neither")
    try:
        # macro_block_size=1: keep the size as it is (H.264 only needs it even; the engine's sizes are).
        with imageio.get_writer(str(tmp), fps=fps, codec="libx264", macro_block_size=1, pixelformat="yuv420p",
                                ffmpeg_log_level="error", **sound) as writer:
            for frame in frames:
                writer.append_data(frame)
    finally:
        if wav is not None:
            wav.unlink(missing_ok=True)
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def probe_media(path: str | Path) -> dict:
    """What ffmpeg says a media file holds (no ffprobe needed): duration and first video and audio stream.

    {"duration_s": float | None, "video": {"codec", "fps"} | None, "audio": {"codec", "sample_rate",
    "channels"} | None}; a file ffmpeg cannot open is a ValueError with its message.
    """
    import imageio_ffmpeg

    # `ffmpeg -i FILE` with no output describes the input on stderr, then exits 1 ("no output file").
    text = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)],
                          capture_output=True, text=True, timeout=60).stderr
    if "Stream #" not in text:
        raise ValueError(f"ffmpeg cannot read {path}: {text.strip()[-300:]}")
    info: dict = {"duration_s": None, "video": None, "audio": None}
    duration = re.search(r"Duration: (\d+):(\d+):(\d+(?:\.\d+)?)", text)
    if duration:
        h, m, sec = duration.groups()
        info["duration_s"] = int(h) * 3600 + int(m) * 60 + float(sec)
    for line in text.splitlines():
        stream = re.search(r"Stream #\S+: (Video|Audio): (\w+)", line)
        if not stream or info[stream.group(1).lower()] is not None:
            continue
        kind, codec = stream.group(1).lower(), stream.group(2)
        if kind == "video":
            fps = re.search(r"([\d.]+) fps", line)
            info["video"] = {"codec": codec, "fps": float(fps.group(1)) if fps else None}
        else:
            rate = re.search(r"(\d+) Hz", line)
            layout = re.search(r"Hz, ([^,]+)", line)
            info["audio"] = {"codec": codec, "sample_rate": int(rate.group(1)) if rate else None,
                             "channels": _channel_count(layout.group(1).strip()) if layout else None}
    return info


def _channel_count(layout: str) -> int | None:
    """Channels of an ffmpeg channel layout name ("mono", "stereo", "6 channels", "5.1")."""
    named = {"mono": 1, "stereo": 2, "2.1": 3, "quad": 4, "5.0": 5, "5.1": 6, "7.1": 8}
    if layout in named:
        return named[layout]
    count = re.match(r"(\d+) channels", layout)
    return int(count.group(1)) if count else None


def read_audio(path: str | Path) -> tuple[torch.Tensor, int]:
    """(audio [channels, samples] float32, sample rate) of the first audio stream of a media file, decoded
    by ffmpeg at the stream's own rate and channel count; ValueError if the file has no audio stream."""
    import imageio_ffmpeg

    stream = probe_media(path)["audio"]
    if stream is None or not stream["sample_rate"] or not stream["channels"]:
        raise ValueError(f"{path} has no audio stream ffmpeg can describe: {stream}")
    channels, rate = stream["channels"], stream["sample_rate"]
    done = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-vn", "-f", "f32le",
                           "-acodec", "pcm_f32le", "-ac", str(channels), "-ar", str(rate), "-"],
                          capture_output=True, timeout=120)
    if done.returncode != 0:
        raise ValueError(f"ffmpeg could not decode the audio of {path}: {done.stderr.decode(errors='replace')[-300:]}")
    samples = np.frombuffer(done.stdout, dtype="<f4").reshape(-1, channels)
    return torch.from_numpy(samples.T.copy()), rate


def read_mp4(path: str | Path) -> np.ndarray:
    """Frames [F, H, W, 3] uint8 of an MP4 file."""
    import imageio.v2 as imageio

    with imageio.get_reader(str(path), format="ffmpeg") as reader:
        return np.stack(list(reader.iter_data()))  # len(reader) is inf for ffmpeg streams


class MiddleFrameRewards:
    """A reward set for videos: scores each video's middle frame; images pass through unchanged."""

    def __init__(self, rewards):
        self.rewards = rewards

    def score(self, images: torch.Tensor, *args, **kwargs):
        if not is_video(images):
            return self.rewards.score(images, *args, **kwargs)
        if getattr(self.rewards, "wants_video", False):  # only then: other reward sets take no videos=
            kwargs = {**kwargs, "videos": images}
        return self.rewards.score(middle_frame(images), *args, **kwargs)

    def __getattr__(self, name):  # everything else (names, weights, repr) is the wrapped set's
        return getattr(self.rewards, name)

    def __repr__(self) -> str:
        return f"MiddleFrameRewards({self.rewards!r})"
