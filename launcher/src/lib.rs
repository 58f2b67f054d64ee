//! The privileged launcher (`agentbox-launcher`): validates requests on `run/launcher.sock`,
//! starts agent and check sandboxes with bubblewrap, runs the git helpers and supervises local
//! vLLM backends.
//!
//! Empty until issue 5 lands it. The rules it enforces already live in `agentbox-policy`.
