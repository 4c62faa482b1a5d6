"""Seams between the session engine and models: plugin and stage-port ABCs, config types."""

from shared.contracts.config import (
    DuplexCapabilities,
    DuplexSessionConfig,
    ResponseCreateOptions,
    SessionRuntimeConfig,
    TurnDetection,
)
from shared.contracts.frame_model import (
    FrameClockedPlugin,
    FrameModel,
    FrameOutput,
    FrameStepError,
    frames_in,
)
from shared.contracts.host import DuplexSessionError, OpenResult, SessionEventSink, SessionHost
from shared.contracts.images import ImageInput, image_format
from shared.contracts.model_history import SIZED_RECORDS, join_records, split_records
from shared.contracts.plugin import (
    CommittedTurn,
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    ResponsePlanRequest,
    last_user_text,
)
from shared.contracts.stages import (
    DuplexFence,
    FunctionCall,
    InputFedStagePort,
    ModelHistory,
    OutputKind,
    OutputSink,
    StageCleanupError,
    StageOutput,
    StagePlan,
    StagePort,
    TextRequest,
    parse_stage_request_id,
    stage_request_id,
)
from shared.contracts.task_stage import TaskStagePort

__all__ = [
    "SIZED_RECORDS",
    "CommittedTurn",
    "DuplexCapabilities",
    "DuplexFence",
    "DuplexModelPlugin",
    "DuplexRuntimeConfigError",
    "DuplexSessionConfig",
    "DuplexSessionError",
    "FrameClockedPlugin",
    "FrameModel",
    "FrameOutput",
    "FrameStepError",
    "FunctionCall",
    "ImageInput",
    "InputFedStagePort",
    "ModelHistory",
    "OpenResult",
    "OutputKind",
    "OutputSink",
    "ResponseCreateOptions",
    "ResponsePlanRequest",
    "SessionEventSink",
    "SessionHost",
    "SessionRuntimeConfig",
    "StageCleanupError",
    "StageOutput",
    "StagePlan",
    "StagePort",
    "TaskStagePort",
    "TextRequest",
    "TurnDetection",
    "frames_in",
    "image_format",
    "join_records",
    "last_user_text",
    "parse_stage_request_id",
    "split_records",
    "stage_request_id",
]
