"""A connector half's agent connection, against a real node agent: the client it opens polls
for answers as the connector's settings say."""

import pytest

from kvstore.connectors.vllm.agent import AgentConnection
from kvstore.connectors.vllm.config import ConnectorSettings
from kvstore.errors import ConfigError
from tests.node.agents import running_agent


def test_the_connection_polls_for_answers_as_the_settings_say(tmp_path, answer_polls):
    with running_agent(tmp_path) as agent:
        for spin_us, expected in ((250, [250e-6, 250e-6]), (0, [])):
            answer_polls.clear()
            settings = ConnectorSettings.from_extra_config(
                {"socket_path": str(agent.config.socket_path), "answer_spin_us": spin_us}
            )
            connection = AgentConnection(settings, "vllm-test")
            assert connection.call(lambda c: c.lookup("t", [bytes(16)]).total, None) == 0
            assert answer_polls == expected  # the hello, the lookup
            connection.drop()


@pytest.mark.parametrize("spin_us", [-1, 10_001])
def test_answer_polling_out_of_range_is_refused(spin_us):
    with pytest.raises(ConfigError, match=r"answer_spin_us must be in \[0, 10000\]"):
        ConnectorSettings.from_extra_config({"answer_spin_us": spin_us})
