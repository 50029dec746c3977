"""Audio in the reward protocol: the two built-in audio rewards on hand-built signals, the RewardSet and
flywheel plumbing (audio and videos reach only the scorers that ask), and audio over the remote-reward wire."""

from __future__ import annotations

import json
import math

import pytest
import torch

import rewards
from flywheel.rollout_collector import Flywheel, eval_samples, reward_inputs
from flywheel.prompts import PromptItem, PromptSampler
from flywheel.video import MiddleFrameRewards
from rewards import RewardSet
from rewards.audio import AudioLoudness, AvOnsetSync
from rewards.remote import RemoteRewardError, RemoteScorer
from rewards.serve import ServerThread
from rewards.wire import SAFETENSORS, decode_request, encode_request

RATE = 16000


def tone(amplitude: float, samples: int = RATE, period: int = 40) -> torch.Tensor:
    """A sine [samples] with a whole number of samples per period (400 Hz at 16 kHz): its RMS is A/sqrt 2 exactly
    over any whole number of periods."""
    return amplitude * torch.sin(2 * math.pi * torch.arange(samples) / period)


def clips(*rows: torch.Tensor) -> torch.Tensor:
    """Mono clips [samples] -> a batch [B, 1, samples]."""
    return torch.stack(rows)[:, None]


def images(batch: int) -> torch.Tensor:
    return torch.rand(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch))


# ---- audio_loudness ----

def test_loudness_golden_values():
    half = tone(0.2)
    half[RATE // 2:] = 0  # loud for 0.5 s, then digital silence
    square = torch.ones(RATE)
    square[::2] = -1  # full scale: RMS 1, 0 dBFS
    audio = clips(tone(0.1), half, square, torch.zeros(RATE))
    scores = AudioLoudness()(images(4), [""] * 4, [{}] * 4, audio=audio, sample_rate=RATE)
    # target -20 dBFS, 10 dB a point, silence penalty 1 point for a wholly silent clip:
    # 0.1 sine: RMS 0.1/sqrt 2 -> 20·log10(0.070711) = -23.0103 dBFS -> -0.30103, nothing silent.
    # half: RMS sqrt(0.5 · 0.2² / 2) = 0.1 -> -20 dBFS on target, half of its 50 ms windows silent -> -0.5.
    # square: 0 dBFS -> -2.0. silence: floored at -100 dBFS -> -8.0, and all silent -> -9.0.
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    assert scores.tolist() == pytest.approx([-0.30103, -0.5, -2.0, -9.0], abs=1e-5)


def test_loudness_settings_move_the_score_as_documented():
    audio = clips(tone(0.1))  # -23.0103 dBFS
    assert AudioLoudness(target_db=-23.0103)(None, [""], [{}], audio=audio, sample_rate=RATE).item() == \
        pytest.approx(0.0, abs=1e-5)
    assert AudioLoudness(db_per_point=20.0)(None, [""], [{}], audio=audio, sample_rate=RATE).item() == \
        pytest.approx(-0.150515, abs=1e-5)
    # A -23 dBFS clip is silent under a -20 dB threshold: every window counts, penalty 2 on top.
    strict = AudioLoudness(silence_db=-20.0, silence_weight=2.0, floor_db=-30.0)
    assert strict(None, [""], [{}], audio=audio, sample_rate=RATE).item() == pytest.approx(-2.30103, abs=1e-5)


def test_loudness_pools_channels_by_energy_and_counts_whole_windows():
    # Two channels in opposite phase are as loud as one of them (averaging the signals would give silence).
    x = tone(0.1)
    stereo = torch.stack([x, -x])[None]
    loudness = AudioLoudness()
    assert loudness(None, [""], [{}], audio=stereo, sample_rate=RATE).item() == pytest.approx(-0.30103, abs=1e-5)
    # 0.12 s at 16 kHz = two whole 50 ms windows (the trailing 20 ms left out); the second one silent.
    clip = tone(0.2, 1920)
    clip[800:] = 0
    assert loudness.silent_fraction(clip[None, None], RATE).tolist() == [0.5]
    # A clip shorter than a window is its own window.
    assert loudness.silent_fraction(torch.zeros(1, 1, 100), RATE).tolist() == [1.0]


def test_loudness_of_non_finite_audio_is_nan_and_bad_settings_are_refused():
    audio = clips(tone(0.1), tone(0.1))
    audio[1, 0, 5] = float("nan")
    scores = AudioLoudness()(None, ["", ""], [{}, {}], audio=audio, sample_rate=RATE)
    assert math.isfinite(scores[0]) and math.isnan(scores[1])
    for kwargs, fragment in [({"target_db": 3.0}, "target_db"), ({"db_per_point": 0}, "db_per_point"),
                             ({"silence_weight": -1}, "silence_weight"), ({"floor_db": -50.0}, "floor_db"),
                             ({"window_s": float("inf")}, "window_s")]:
        with pytest.raises(ValueError, match=fragment):
            AudioLoudness(**kwargs)


# ---- av_onset_sync ----
# 8 frames over 800 samples: 100 samples per frame, a sine of period 4 (25 whole periods a frame), so a
# span's RMS is exactly 0 or A/sqrt 2 and the envelopes are exact step functions.

FRAMES, SAMPLES = 8, 800


def burst(start: int, stop: int = FRAMES, amplitude: float = 0.5) -> torch.Tensor:
    """[SAMPLES]: silence, then a tone from frame `start` to frame `stop` (exclusive)."""
    x = torch.zeros(SAMPLES)
    x[start * 100:stop * 100] = tone(amplitude, SAMPLES, period=4)[start * 100:stop * 100]
    return x


def cut(*changes: int, frames: int = FRAMES) -> torch.Tensor:
    """[3, F, 4, 4]: black, switching between black and white at each frame in `changes`."""
    level = torch.zeros(frames)
    for k in changes:
        level[k:] = 1 - level[k:]
    return level[None, :, None, None].expand(3, frames, 4, 4).clone()


def sync(audio_rows, video_rows, **kwargs) -> list[float]:
    audio, videos = clips(*audio_rows), torch.stack(video_rows)
    return AvOnsetSync(**kwargs)(videos[:, :, 0], [""] * len(audio), [{}] * len(audio), audio=audio,
                                 sample_rate=800, videos=videos).tolist()


def test_onset_sync_golden_values_for_a_burst_at_the_cut_and_away_from_it():
    # Onset and motion envelopes have 7 entries (changes into frames 1..7).
    # Burst at the cut (frame 4): both one-hot at the same entry -> 1.
    # Burst at frame 6, cut at 4: two one-hots of length n = 7 at different places:
    #   cov = (0 - n·(1/n)²)/n, var = (1 - 1/n)/n -> r = -1/(n - 1) = -1/6; at lag ±1 the overlaps are 6 long and
    #   still one-hot apart -> -1/5 each; the best of the three is -1/6.
    assert sync([burst(4), burst(6)], [cut(4), cut(4)]) == pytest.approx([1.0, -1 / 6], abs=1e-6)


def test_onset_sync_forgives_max_lag_frames_either_way_and_no_more():
    late, early = burst(5), burst(3)  # sound one frame after / before the cut at 4
    assert sync([late, early], [cut(4), cut(4)]) == pytest.approx([1.0, 1.0], abs=1e-6)
    assert sync([late, early], [cut(4), cut(4)], max_lag_frames=0) == pytest.approx([-1 / 6, -1 / 6], abs=1e-6)
    assert sync([burst(6)], [cut(4)], max_lag_frames=2) == pytest.approx([1.0], abs=1e-6)


def test_onset_sync_counts_rises_of_sound_and_any_change_of_picture():
    # Tone over frames 2..4 (it stops at 5); the picture turns white at 2 and black again at 5.
    # Onsets: only the rise, x = e_1 (a stop is not an onset); motion: both changes, y = e_1 + e_4 (n = 7).
    # Sum xy = 1, means 1/7 and 2/7: cov·n = 1 - 2/7 = 5/7, var_x·n = 6/7, var_y·n = 2 - 4/7 = 10/7,
    # r = (5/7) / sqrt(60/49) = 5/sqrt(60) = 0.645497.
    assert sync([burst(2, 5)], [cut(2, 5)], max_lag_frames=0) == pytest.approx([5 / math.sqrt(60)], abs=1e-6)


def test_onset_sync_is_zero_with_nothing_to_align_and_pools_channels_by_energy():
    steady, still = burst(0), cut()
    # A tone from the start has no onset; a still video no motion: 0 either way, not NaN.
    assert sync([steady, burst(4), torch.zeros(SAMPLES)], [cut(4), still, cut(4)]) == [0.0, 0.0, 0.0]
    # Opposite-phase channels are as good as one.
    x = burst(4)
    videos = cut(4)[None]
    stereo = AvOnsetSync()(None, [""], [{}], audio=torch.stack([x, -x])[None], sample_rate=800, videos=videos)
    assert stereo.tolist() == pytest.approx([1.0], abs=1e-6)
    nan = burst(4)
    nan[3] = float("nan")
    assert math.isnan(sync([nan], [cut(4)])[0])


def test_onset_sync_frame_spans_tile_uneven_clips():
    # 10 samples over 3 frames: sample n belongs to frame floor(3n/10) -> spans of 4, 3 and 3 samples.
    audio = torch.tensor([0.5, -0.5, 0.5, -0.5, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0])[None, None]
    assert AvOnsetSync.frame_energy(audio, 3)[0].tolist() == pytest.approx([0.5, 1.0, 0.0])
    with pytest.raises(ValueError, match="at least 3 frames"):
        sync([burst(1)], [cut(1, frames=2)])
    with pytest.raises(ValueError, match="shorter than the video's 8 frames"):
        AvOnsetSync()(None, [""], [{}], audio=torch.zeros(1, 1, 5), sample_rate=5, videos=cut(4)[None])
    with pytest.raises(ValueError, match="max_lag_frames"):
        AvOnsetSync(max_lag_frames=-1)


# ---- the protocol: RewardSet, MiddleFrameRewards, the flywheel ----

def test_reward_set_gives_audio_only_to_scorers_that_ask_and_old_scorers_are_called_as_before():
    calls = []

    def image_mean(images, prompts, metadata):  # an image scorer written before audio existed
        calls.append("image")
        return images.flatten(1).mean(1)

    rewards.register("test_image_mean", lambda: image_mean)
    try:
        reward_set = RewardSet("test_image_mean:1,audio_loudness:2")
        assert reward_set.wants_audio and not reward_set.wants_video
        x = images(2)
        audio = clips(tone(0.1), torch.zeros(RATE))
        batch = reward_set.score(x, ["a", "b"], None, weight_version=4, audio=audio, sample_rate=RATE)
        assert batch.valid.all() and not batch.errors and calls == ["image"]
        assert batch.scores["audio_loudness"].tolist() == pytest.approx([-0.30103, -9.0], abs=1e-5)
        assert torch.allclose(batch.total, x.flatten(1).mean(1) + 2 * batch.scores["audio_loudness"])
        # Without audio an image-only set works as ever; a set that needs audio names the scorer.
        assert RewardSet("test_image_mean").score(x, ["a", "b"], None, 0).valid.all()
        assert not RewardSet("test_image_mean").wants_audio
        with pytest.raises(ValueError, match="'audio_loudness' needs audio"):
            reward_set.score(x, ["a", "b"], None, 0)
    finally:
        rewards.registry.unregister("test_image_mean")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"audio": torch.zeros(2, 1, 10)}, "sample rate"),
    ({"audio": torch.zeros(2, 1, 10), "sample_rate": 0}, "sample rate"),
    ({"audio": torch.zeros(2, 1, 10), "sample_rate": 8000.0}, "sample rate"),
    ({"audio": torch.zeros(3, 1, 10), "sample_rate": 8000}, "B = 2"),
    ({"audio": torch.zeros(2, 10), "sample_rate": 8000}, "[B, channels, samples]"),
    ({"audio": torch.zeros(2, 1, 10, dtype=torch.int16), "sample_rate": 8000}, "floating point"),
    ({"sample_rate": 8000}, "sample_rate but no audio"),
    ({"videos": torch.zeros(2, 3, 8, 8)}, "[B, C, F, H, W]"),
])
def test_reward_set_refuses_malformed_audio_and_videos(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        RewardSet("audio_loudness").score(images(2), ["a", "b"], None, 0, **kwargs)
    assert fragment in str(err.value)


def test_videos_reach_the_sync_scorer_while_image_scorers_see_the_middle_frame():
    seen = []

    def middle_probe(images, prompts, metadata):
        seen.append(images)
        return images.flatten(1).mean(1)

    rewards.register("test_middle_probe", lambda: middle_probe)
    try:
        videos = torch.stack([cut(4), cut(4)])
        audio = clips(burst(4), burst(6))
        wrapped = MiddleFrameRewards(RewardSet("test_middle_probe,av_onset_sync"))
        assert wrapped.wants_video and wrapped.wants_audio
        batch = wrapped.score(videos, ["a", "b"], None, 1, audio=audio, sample_rate=800)
        assert torch.equal(seen[0], videos[:, :, FRAMES // 2])
        assert batch.scores["av_onset_sync"].tolist() == pytest.approx([1.0, -1 / 6], abs=1e-6)
        # Called on images, the sync scorer has no videos to read and says so.
        with pytest.raises(ValueError, match="'av_onset_sync' needs videos"):
            RewardSet("av_onset_sync").score(videos[:, :, 0], ["a", "b"], None, 1, audio=audio, sample_rate=800)
        # A set called on videos directly (no wrapper) hands them over as they are.
        direct = RewardSet("av_onset_sync").score(videos, ["a", "b"], None, 1, audio=audio, sample_rate=800)
        assert torch.equal(direct.scores["av_onset_sync"], batch.scores["av_onset_sync"])
    finally:
        rewards.registry.unregister("test_middle_probe")


class SoundingEngine:
    """The toy engine, its trajectories given a tone whose loudness follows the seed (what an audio card returns)."""

    def __init__(self, engine):
        self.engine, self.card_id = engine, engine.card_id

    @staticmethod
    def sound(seed: int) -> torch.Tensor:
        return tone(0.01 + 0.5 * (seed % 97) / 97, 800)[None]

    def generate(self, requests):
        traj = self.engine.generate(requests)
        traj.audio = torch.stack([self.sound(r.seed) for r in requests])
        traj.audio_sample_rate = 8000
        return traj


def test_flywheel_scores_the_trajectorys_audio_in_rollouts_and_evaluation(toy_engine):
    engine = SoundingEngine(toy_engine)
    items = [PromptItem("zero", {"digit": 0}), PromptItem("one", {"digit": 1})]
    wheel = Flywheel(engine, RewardSet("audio_loudness"), PromptSampler(items, prompts_per_step=2, seed=0), 2,
                     request_kwargs=dict(steps=2, sampler="sde", noise_level=0.7), seed=3, rollout_chunk_size=3)
    batch = wheel.collect(0)  # two chunks (3 + 1 rows), each scored on its own audio
    expected = AudioLoudness()(None, [""] * 4, [{}] * 4, audio=torch.stack([engine.sound(s) for s in
                                                                             batch.trajectory.seeds]),
                               sample_rate=8000)
    assert torch.equal(batch.rewards.scores["audio_loudness"], expected)
    assert len(set(expected.tolist())) == 4  # the rows really differ: the right clip went with each row
    metrics, traj = eval_samples(engine, wheel.rewards, items, 1, dict(steps=2, sampler="ode"))
    assert metrics["eval/reward/mean"] == pytest.approx(float(AudioLoudness()(
        None, [""] * 2, [{}] * 2, audio=traj.audio, sample_rate=8000).mean()), abs=1e-6)
    # A trajectory without sound adds nothing to the call (reward sets that take no audio keep working).
    assert reward_inputs(traj) == {"audio": traj.audio, "sample_rate": 8000}
    assert reward_inputs(toy_engine.generate([wheel._request(items[0], seed=1)])) == {}
    with pytest.raises(ValueError, match="'audio_loudness' needs audio"):
        Flywheel(toy_engine, RewardSet("audio_loudness"), PromptSampler(items, prompts_per_step=2, seed=0), 2,
                 request_kwargs=dict(steps=1), seed=3).collect(0)


# ---- over the wire ----

def test_wire_carries_audio_its_rate_and_videos_exactly_as_safetensors():
    audio, videos = torch.randn(2, 2, 50).clamp(-1, 1), torch.rand(2, 3, 4, 8, 8)
    body, content_type = encode_request(images(2), ["a", "b"], [{"k": 1}, {}], audio=audio, sample_rate=22050,
                                        videos=videos)
    assert content_type == SAFETENSORS
    header = json.loads(body[8:8 + int.from_bytes(body[:8], "little")])  # a safetensors file, not a pickle
    assert header["__metadata__"]["sample_rate"] == "22050"
    assert header["audio"]["shape"] == [2, 2, 50] and header["audio"]["dtype"] == "F32"
    request = decode_request(body, content_type)
    assert torch.equal(request.audio, audio) and request.sample_rate == 22050 and torch.equal(request.videos, videos)
    assert request.prompts == ["a", "b"] and request.metadata == [{"k": 1}, {}]
    plain = decode_request(*encode_request(images(2), ["a", "b"], [{}, {}]))
    assert plain.audio is None and plain.sample_rate is None and plain.videos is None
    with pytest.raises(ValueError, match="only in a safetensors request"):
        encode_request(images(2), ["a", "b"], [{}, {}], "png", audio=audio, sample_rate=8000)
    with pytest.raises(ValueError, match="B = 2"):
        encode_request(images(2), ["a", "b"], [{}, {}], audio=audio[:1], sample_rate=8000)


def test_wire_refuses_audio_without_a_usable_rate():
    from safetensors.torch import save

    header = {"prompts": json.dumps(["a"]), "metadata": json.dumps([{}])}
    tensors = {"images": torch.zeros(1, 3, 2, 2), "audio": torch.zeros(1, 1, 4)}
    for extra in ({}, {"sample_rate": "0"}, {"sample_rate": "fast"}):
        with pytest.raises(ValueError, match="sample rate|bad safetensors"):
            decode_request(save(tensors, metadata={**header, **extra}), SAFETENSORS)


def test_audio_rewards_through_the_http_server_equal_in_process_scores():
    audio = clips(burst(4), burst(6), torch.zeros(SAMPLES))
    videos = torch.stack([cut(4), cut(4), cut(2)])
    local = MiddleFrameRewards(RewardSet("audio_loudness,av_onset_sync:0.5")).score(
        videos, ["a", "b", "c"], None, 2, audio=audio, sample_rate=800)
    with ServerThread(rewards.get("audio_loudness"), "audio_loudness") as loud, \
            ServerThread(rewards.get("av_onset_sync"), "av_onset_sync") as av:
        client = RemoteScorer(loud.url)
        assert (client.wants_audio, client.wants_video) == (True, False)
        spec = {f"remote:{loud.url}": 1.0, f"remote:{av.url}": 0.5}
        remote = MiddleFrameRewards(RewardSet(spec)).score(videos, ["a", "b", "c"], None, 2, audio=audio,
                                                            sample_rate=800)
        assert remote.valid.all() and not remote.errors
        assert torch.equal(remote.scores[f"remote:{loud.url}"], local.scores["audio_loudness"])
        assert torch.equal(remote.scores[f"remote:{av.url}"], local.scores["av_onset_sync"])
        assert torch.equal(remote.total, local.total)
        # The client knows the reward needs audio: a batch without it is refused before anything is sent...
        with pytest.raises(ValueError, match=f"'remote:{loud.url}' needs audio"):
            RewardSet(f"remote:{loud.url}").score(images(3), ["a", "b", "c"], None, 0)
        # ...and a client that sends none anyway is answered 400 naming the reward.
        with pytest.raises(RemoteRewardError, match="HTTP 400.*'audio_loudness' needs audio"):
            client(images(3), ["a", "b", "c"], [{}] * 3)
        with pytest.raises(ValueError, match="needs audio; these travel only with encoding='safetensors'"):
            RemoteScorer(loud.url, encoding="png")
