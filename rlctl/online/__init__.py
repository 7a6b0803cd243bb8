"""The online half: the gRPC sidecar, the live loop that steers an engine through it, the actuators and the engine's metrics."""
