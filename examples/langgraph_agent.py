"""A tool-using LangGraph agent (LangChain's `ChatOpenAI`) recorded as one rollout.

The agent loop is the usual one: the model answers or calls a tool, tool results go back
to the model, until it answers without a tool call (or `MAX_AGENT_STEPS` is reached).
Every model call goes through Turnstile under the rollout's `base_url`, so the whole
episode (tool calls, tool results, answers) lands in one rollout.

    pip install langchain-openai langgraph
    python examples/langgraph_agent.py
"""

from __future__ import annotations

from typing import Any

from _common import MAX_TOKENS, MODEL, create_rollout, reward_and_finish
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import SecretStr

# Model calls plus tool steps before the graph stops the episode.
MAX_AGENT_STEPS = 8
QUESTION = "What is 17 * 23? Use the multiply tool."


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def build_agent(base_url: str, api_key: str) -> Any:
    llm = ChatOpenAI(
        model=MODEL,
        base_url=base_url,
        api_key=SecretStr(api_key),
        max_completion_tokens=MAX_TOKENS,
        temperature=1.0,
        max_retries=0,
    )
    model = llm.bind_tools([multiply])

    def agent(state: MessagesState) -> dict[str, list[AIMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([multiply]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def main() -> None:
    rollout = create_rollout(
        group_id="langgraph-demo", task_id="multiply", metadata={"harness": "langgraph"}
    )
    agent = build_agent(rollout["base_url"], rollout["api_key"] or "unused")
    result = agent.invoke(
        {"messages": [HumanMessage(QUESTION)]},
        {"recursion_limit": MAX_AGENT_STEPS},
    )
    messages = result["messages"]
    tool_calls = sum(len(getattr(m, "tool_calls", []) or []) for m in messages)
    final = str(messages[-1].content)
    rewards = {"correct": float("391" in final), "used_tool": float(tool_calls > 0)}
    summary = reward_and_finish(
        rollout["rollout_id"], rewards, {"correct": f"final answer: {final[:200]!r}"}
    )
    print(
        f"rollout {rollout['rollout_id']}: {len(messages)} messages, {tool_calls} tool "
        f"calls, {summary['status']}, rewards {summary['rewards']}"
    )


if __name__ == "__main__":
    main()
