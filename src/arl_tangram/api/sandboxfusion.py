"""SandboxFusion's HTTP interface, exactly (docs/sandboxfusion.md): existing clients
(the ``sandbox-fusion`` package, verl's reward utilities and SandboxFusionTool) validate responses
against these enums, so no status value is ever added; extra detail goes in ``message``."""

from __future__ import annotations

import enum
from typing import Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, Field
from typing_extensions import Annotated

from ..core.names import MAX_MEMORY_MB, check_paths, check_text

Language = Literal[
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust",
    "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
    "verilog", "python_gpu", "lean", "swift", "racket", "python2", "gtest", "react"]


#: file names are checked where they enter (unchecked, a NUL byte ends a run ``Failed`` with no record of why):
#: a 422 naming ``files``/``fetch_files``, as for any other malformed field. Unknown fields are
#: ignored, as SandboxFusion's own request models (plain pydantic ``BaseModel``s) ignore them.
FileMap = Annotated[dict[str, Optional[str]], AfterValidator(check_paths)]
FileList = Annotated[list[str], AfterValidator(check_paths)]
#: program text and stdin: what JSON can carry but UTF-8 cannot (a lone surrogate) is a 422 here
Text = Annotated[str, AfterValidator(check_text)]


class CommandRunStatus(str, enum.Enum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class RunStatus(str, enum.Enum):
    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: Optional[float] = None
    return_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None


class RunCodeRequest(BaseModel):
    code: Text
    language: Language
    compile_timeout: float = Field(10, gt=0, le=3600)
    run_timeout: float = Field(10, gt=0, le=3600)
    memory_limit_MB: int = Field(-1, ge=-1, le=MAX_MEMORY_MB)
    stdin: Optional[Text] = None
    files: FileMap = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: FileList = Field(default_factory=list)


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: Optional[CommandRunResult] = None
    run_result: Optional[CommandRunResult] = None
    executor_pod_name: Optional[str] = None
    files: dict[str, str] = Field(default_factory=dict)


class RunJupyterRequest(BaseModel):
    cells: list[Text]
    cell_timeout: float = Field(0, ge=0, le=3600)
    total_timeout: float = Field(45, gt=0, le=3600)
    memory_limit_MB: int = Field(-1, ge=-1, le=MAX_MEMORY_MB)
    kernel: Literal["python3"] = "python3"
    files: FileMap = Field(default_factory=dict)
    fetch_files: FileList = Field(default_factory=list)


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]] = Field(default_factory=list)
    error: list[dict[str, Any]] = Field(default_factory=list)


class RunJupyterResponse(BaseModel):
    status: RunStatus
    message: str
    driver: Optional[CommandRunResult] = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: Optional[str] = None
    files: dict[str, str] = Field(default_factory=dict)
