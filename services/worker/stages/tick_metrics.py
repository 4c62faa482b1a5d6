"""`TickMetrics`: the Prometheus metrics of a frame-clocked model's tick-batched stage
(`tick_batched.py`): its clock, its slots and its restores, labelled with the model.

Beside the stage that writes them, so the stages import nothing of the worker above them;
the worker's registry (`services/worker/metrics.py`) holds them and serves `/metrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# One set of buckets serves every model's clock (a metric's buckets are the same for all
# its labels): fine steps around Mimi's 80 ms frame, and on to past a 1 s unit's.
#: a tick's step time: under a frame is on time (80 ms for Mimi; a 1 s unit's step can take
#: hundreds of ms), so the range is 1 ms - 2.5 s
TICK_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.16, 0.25, 0.5),
    *(0.75, 1.0, 1.5, 2.5),
)
#: input buffered ahead of the clock: about one frame is healthy (80 ms; a 1 s unit's up to
#: 2 s, its next unit filling while one waits for the tick), seconds more is a client ahead
LAG_BUCKETS = (0.0, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)


#: a native session's restore: a short history in one tick, Moshi's whole context in a few
#: s, a 1 s-unit model's long conversation (every unit a forward of its own) in minutes
RESTORE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: a restore's pace (seconds of conversation replayed per second): under 1 it never catches up
PACE_BUCKETS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)


class TickMetrics:
    """The tick-batched stage's clock, labelled with the model (`model`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "duplex_tick_duration_seconds",
            "Time of one batched model step (all slots, one frame)",
            ["model"],
            buckets=TICK_BUCKETS,
            registry=registry,
        )
        self.deadline_misses = Counter(
            "duplex_tick_deadline_misses_total",
            "Ticks whose step ended after the next frame was due (the grid resyncs)",
            ["model"],
            registry=registry,
        )
        self.silence_frames = Counter(
            "duplex_tick_silence_frames_total",
            "Frames stepped on silence because a session's input had not arrived",
            ["model"],
            registry=registry,
        )
        self.catch_up_steps = Counter(
            "duplex_tick_catch_up_steps_total",
            "Steps between two ticks of client-clocked sessions (Moshi's protocol) whose "
            "client was more than a frame ahead",
            ["model"],
            registry=registry,
        )
        self.dropped_images = Counter(
            "duplex_tick_dropped_images_total",
            "Camera frames not passed to the model: more came due for one frame of input "
            "than the model takes (the oldest go), or the model takes none",
            ["model"],
            registry=registry,
        )
        self.input_lag = Histogram(
            "duplex_tick_input_lag_seconds",
            "Input buffered ahead of the clock, per session per tick",
            ["model"],
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.slots = Gauge(
            "duplex_tick_slots", "Slots of the model's batch", ["model"], registry=registry
        )
        self.slots_active = Gauge(
            "duplex_tick_slots_active",
            "Slots held by a session (stepped as active)",
            ["model"],
            registry=registry,
        )
        self.restored_frames = Counter(
            "duplex_native_restored_frames_total",
            "Frames of model-native sessions' histories replayed into a slot (restores)",
            ["model"],
            registry=registry,
        )
        self.restore_duration = Histogram(
            "duplex_native_restore_seconds",
            "From a restored session's slot open to its first step (its history replayed)",
            ["model"],
            buckets=RESTORE_BUCKETS,
            registry=registry,
        )
        self.restore_pace = Histogram(
            "duplex_native_restore_pace",
            "A finished restore's pace: seconds of conversation replayed per second",
            ["model"],
            buckets=PACE_BUCKETS,
            registry=registry,
        )
        self.restores_in_progress = Gauge(
            "duplex_native_restores_in_progress",
            "Slots replaying a history or a prompt (not stepped until it is done)",
            ["model"],
            registry=registry,
        )
        self.replay_frames_left = Gauge(
            "duplex_native_replay_frames_left",
            "Frames the slots replaying still have to replay, all together",
            ["model"],
            registry=registry,
        )
