"""Wire schemas (pydantic), separate from internal types: SandboxFusion-compatible and native v1."""
