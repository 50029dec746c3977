"""Audio outputs: WAV files, MP4 files with the audio track muxed in (read back through ffmpeg), and the trackers."""

from __future__ import annotations

import logging
import math
import wave

import numpy as np
import pytest
import torch

from flywheel.runs.tracking import log_videos
from flywheel.video import probe_media, read_audio, read_mp4, read_wav, write_mp4, write_wav

RATE = 16000


def tone(freq: float, amplitude: float, seconds: float = 1.0, rate: int = RATE) -> torch.Tensor:
    """A sine [samples] at `freq` Hz."""
    return amplitude * torch.sin(2 * math.pi * freq * torch.arange(round(seconds * rate)) / rate)


def stereo(seconds: float = 1.0, rate: int = RATE) -> torch.Tensor:
    """[2, samples]: a loud 440 Hz left channel and a quieter 660 Hz right one (channel order shows)."""
    return torch.stack([tone(440, 0.5, seconds, rate), tone(660, 0.2, seconds, rate)])


def video(frames: int = 16, height: int = 16, width: int = 24) -> torch.Tensor:
    """A smooth [3, F, H, W] clip in [0, 1]."""
    ramp = torch.linspace(0.1, 0.9, width)[None, None, :].expand(frames, height, width)
    return torch.stack([ramp * (0.5 + 0.02 * torch.arange(frames)[:, None, None])] * 3)


# ---- WAV ----

def test_wav_round_trip_is_within_half_a_16_bit_step(tmp_path):
    audio = stereo(0.25)
    path = write_wav(audio, RATE, tmp_path / "sub" / "a.wav")
    assert path.is_file() and not list(tmp_path.glob("sub/*.partial.wav"))
    back, rate = read_wav(path)
    assert rate == RATE and back.shape == audio.shape and back.dtype == torch.float32
    assert (back - audio).abs().max() <= 0.5 / 32767 + 1e-7
    with wave.open(str(path)) as f:  # what other programs see
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()) == (2, 2, RATE, 4000)


def test_wav_samples_are_scaled_clipped_and_interleaved_as_pcm_says(tmp_path):
    # Full scale is 32767 both ways; values past [-1, 1] are clipped; NaN is written as 0.
    audio = torch.tensor([[1.0, -1.0, 0.5, 2.0, float("nan")], [0.0, 0.25, -0.5, -3.0, 1.0 / 32767]])
    path = write_wav(audio, 8000, tmp_path / "a.wav")
    with wave.open(str(path)) as f:
        frames = np.frombuffer(f.readframes(5), dtype="<i2")
    # 0.5 * 32767 = 16383.5 rounds half to even: 16384; 0.25 * 32767 = 8191.75 -> 8192.
    assert frames.tolist() == [32767, 0, -32767, 8192, 16384, -16384, 32767, -32767, 0, 1]
    back, _ = read_wav(path)
    assert back[0, :2].tolist() == [1.0, -1.0]
    mono = write_wav(tone(100, 0.5, 0.01, 8000)[None], 8000, tmp_path / "m.wav")
    assert read_wav(mono)[0].shape == (1, 80)


@pytest.mark.parametrize("audio, rate, fragment", [
    (torch.zeros(2, 3, 10), RATE, "[channels, samples]"),
    (torch.zeros(1, 0), RATE, "[channels, samples]"),
    (torch.zeros(1, 10), 0, "positive integer"),
    (torch.zeros(1, 10), 16000.0, "positive integer"),
    (torch.zeros(1, 10), True, "positive integer"),
])
def test_write_wav_refuses_bad_clips_and_rates(tmp_path, audio, rate, fragment):
    with pytest.raises(ValueError) as err:
        write_wav(audio, rate, tmp_path / "a.wav")
    assert fragment in str(err.value)


# ---- MP4 with sound ----

def test_mp4_carries_a_video_and_an_audio_stream_of_the_right_rate_and_length(tmp_path):
    audio = stereo(1.0)
    path = write_mp4(video(frames=16), tmp_path / "av.mp4", fps=16, audio=audio, sample_rate=RATE)
    assert not list(tmp_path.glob("*.partial.*"))  # neither the partial MP4 nor the WAV it muxed is left
    info = probe_media(path)
    assert info["video"]["codec"] == "h264" and info["video"]["fps"] == 16.0
    assert info["audio"] == {"codec": "aac", "sample_rate": RATE, "channels": 2}
    assert info["duration_s"] == pytest.approx(1.0, abs=0.05)
    assert read_mp4(path).shape == (16, 16, 24, 3)  # the picture is still there


def test_mp4_audio_decodes_back_to_the_input_within_codec_tolerance(tmp_path):
    audio = stereo(1.0)
    back, rate = read_audio(write_mp4(video(), tmp_path / "av.mp4", fps=16, audio=audio, sample_rate=RATE))
    assert rate == RATE and back.shape[0] == 2
    assert abs(back.shape[1] - RATE) <= 1024  # one AAC frame at most, if the encoder's padding were kept
    n = min(back.shape[1], audio.shape[1])
    inner = slice(1024, n - 1024)  # AAC smears its first and last frame; compare the middle
    for channel, (freq, amplitude) in enumerate([(440, 0.5), (660, 0.2)]):
        got, sent = back[channel, inner], audio[channel, inner]
        rms = amplitude / math.sqrt(2)  # of a sine
        # Same loudness per channel, so the channels are neither swapped nor mixed...
        assert got.pow(2).mean().sqrt() == pytest.approx(rms, rel=0.01)
        # ...and the same waveform in time: measured error 0.2 % of the RMS; a shift of one sample
        # would already cost 2 % at 660 Hz (and the correlation would drop to cos(2π·660/16000) = 0.967).
        assert (got - sent).pow(2).mean().sqrt() < 0.01 * rms
        assert torch.corrcoef(torch.stack([got, sent]))[0, 1] > 0.999


def test_mp4_without_audio_has_no_audio_stream_and_a_rate_alone_is_refused(tmp_path):
    path = write_mp4(video(frames=4), tmp_path / "v.mp4", fps=8)
    info = probe_media(path)
    assert info["audio"] is None and info["video"]["fps"] == 8.0
    with pytest.raises(ValueError, match="has no audio stream"):
        read_audio(path)
    with pytest.raises(ValueError, match="sample_rate but no audio"):
        write_mp4(video(frames=4), tmp_path / "x.mp4", sample_rate=RATE)
    with pytest.raises(ValueError, match="cannot read"):
        probe_media(tmp_path / "missing.mp4")


def test_mp4_resamples_a_rate_aac_lacks_and_warns_when_the_lengths_differ(tmp_path, caplog):
    odd = 11111  # not an AAC rate: resampled to 48 kHz, the clip still plays
    with caplog.at_level(logging.WARNING, logger="flywheel.video"):
        path = write_mp4(video(frames=8), tmp_path / "odd.mp4", fps=16, audio=tone(300, 0.3, 1.0, odd)[None],
                         sample_rate=odd)
    assert probe_media(path)["audio"]["sample_rate"] == 48000
    # 8 frames at 16 fps last 0.5 s, the audio 1 s: the warning points at fps.
    assert "audio lasts 1.000 s and the video 0.500 s" in caplog.text and "fps" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flywheel.video"):
        write_mp4(video(frames=16), tmp_path / "ok.mp4", fps=16, audio=tone(300, 0.3)[None], sample_rate=RATE)
    assert "audio lasts" not in caplog.text


# ---- trackers ----

def test_wandb_offline_logs_the_mp4_with_its_sound(tmp_path):
    from accelerate import PartialState
    from accelerate.tracking import WandBTracker

    PartialState()  # accelerate's tracker logs through its state
    path = write_mp4(video(), tmp_path / "av.mp4", fps=16, audio=stereo(), sample_rate=RATE)
    tracker = WandBTracker("audio-io", dir=str(tmp_path / "run"), mode="offline")
    tracker.start()
    try:

        class Accelerator:
            trackers = [tracker]

        log_videos(Accelerator(), "eval/videos", [path], step=3)
    finally:
        tracker.finish()
    logged = list((tmp_path / "run").glob("wandb/offline-run-*/files/media/videos/eval/*.mp4"))
    assert len(logged) == 1
    info = probe_media(logged[0])
    assert info["audio"] == {"codec": "aac", "sample_rate": RATE, "channels": 2} and info["video"] is not None


def test_tensorboard_gets_the_frame_strip_and_the_sound_in_mono(tmp_path):
    logged = []

    class Writer:
        def add_image(self, tag, image, step, dataformats):
            logged.append((tag, image.shape, step))

        def add_audio(self, tag, audio, step, sample_rate):
            logged.append((tag, tuple(audio.shape), step, sample_rate, audio))

    class Tracker:
        name = "tensorboard"
        writer = Writer()

    class Accelerator:
        trackers = [Tracker()]

    # The mono mix is the mean of the channels: 0.4 and 0.2 in phase give a 0.3 sine.
    audio = torch.stack([tone(440, 0.4), tone(440, 0.2)])
    with_sound = write_mp4(video(frames=4), tmp_path / "av.mp4", fps=4, audio=audio, sample_rate=RATE)
    silent = write_mp4(video(frames=4), tmp_path / "v.mp4", fps=4)
    log_videos(Accelerator(), "eval/videos", [with_sound, silent], step=5)
    assert [entry[:3] for entry in logged] == [("eval/videos/0", (16, 4 * 24, 3), 5),
                                               ("eval/videos/0/audio", (1, logged[1][1][1]), 5),
                                               ("eval/videos/1", (16, 4 * 24, 3), 5)]
    tag, shape, step, rate, mono = logged[1]
    assert rate == RATE and abs(shape[1] - RATE) <= 1024
    middle = mono[0, 2048:-2048]
    assert middle.pow(2).mean().sqrt() == pytest.approx(0.3 / math.sqrt(2), rel=0.01)
