"""Agents written against the ``openai`` client, trained as they run: the policy behind an
OpenAI-compatible endpoint, every model call recorded token-exactly into the episode.

``AgentServer`` (one per EnvRunner) serves the engine; ``open_session`` gives each episode its own
``base_url``; ``AgentSession.to_episode`` builds the recorded ``Episode`` (one segment per context
the agent used). See ``docs/agents.md``.
"""

from flashrl.agents.server import AgentLimits, AgentServer, AgentSession, ConnectionLimits

__all__ = ["AgentLimits", "AgentServer", "AgentSession", "ConnectionLimits"]
