"""The MCP server (starqa.servers.mcp) through the official SDK's own client: in process
over fake contexts (tools, resources, errors), then over stdio as an agent runs it:
list the tools, ingest a folder with the tiny random model, ask, get sources."""

import json
import os
import sys

import anyio
import pytest

from starqa.api import doors
from starqa.servers import mcp as door

QUESTION = "who approved the travel budget"


def structured(result) -> dict | list:
    assert not result.is_error, result.content
    return result.structured_content


def run(main):
    return anyio.run(main)


def test_tools_contexts_and_resources_in_process(contexts):
    from mcp import Client

    async def main():
        async with Client(door.server(doors.Service())) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == {"list_contexts", "ingest", "ask", "search", "read"}
            assert tools["ask"].input_schema["required"] == ["question"]
            assert tools["ask"].output_schema["type"] == "object"  # structured answers
            assert set(tools["ingest"].input_schema["properties"]) == {
                "path", "name", "model", "method", "include", "exclude"}
            listed = structured(await client.call_tool("list_contexts", {}))["result"]
            assert [c["ref"] for c in listed] == ["docs", "repo", "old"]
            resources = (await client.list_resources()).resources
            assert [str(r.uri) for r in resources] == [
                "starqa://contexts/docs", "starqa://contexts/repo", "starqa://contexts/old"]
            read = await client.read_resource("starqa://contexts/repo")
            facts = json.loads(read.contents[0].text)
            assert facts["method"] == "dense" and facts["files"] == ["a.md", "b.py"]
            assert facts["skipped"] == [{"path": "logo.png", "reason": "binary"}]
            failed = await client.call_tool("ask", {"question": QUESTION, "context": "nope"})
            assert failed.is_error
            assert "No context named 'nope'" in failed.content[0].text
            assert "hint: known contexts: docs, old, repo" in failed.content[0].text

    run(main)


@pytest.mark.slow
def test_an_agent_ingests_a_folder_and_asks_over_stdio(home, docs, tiny_model):
    from mcp import Client, StdioServerParameters

    server = StdioServerParameters(
        command=sys.executable, args=["-m", "starqa.servers.mcp"], cwd=str(docs.parent),
        env={**os.environ, "STARQA_HOME": str(home), "STARQA_MIN_COPIED": "0"})

    async def main():
        async with Client(server, read_timeout_seconds=300) as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            assert tools == ["list_contexts", "ingest", "ask", "search", "read"]
            assert structured(await client.call_tool("list_contexts", {}))["result"] == []
            told = []

            async def progress(done, total, message):
                told.append((done, total, message))

            made = structured(await client.call_tool(
                "ingest", {"path": "docs", "model": str(tiny_model), "exclude": ["*.py"]},
                progress_callback=progress))
            assert made["ref"] == "docs" and made["cache_hit"] is False
            assert told and told[-1][0] == told[-1][1] == made["tokens"]  # every token encoded
            assert [done for done, _, _ in told] == sorted({d for d, _, _ in told})
            assert sorted(made["files"]) == ["policy/leave.md", "policy/travel.md"]
            again = structured(await client.call_tool(
                "ingest", {"path": "docs", "model": str(tiny_model), "exclude": ["*.py"]}))
            assert again["cache_hit"] is True and again["key"] == made["key"]
            told.clear()
            answer = structured(await client.call_tool(
                "ask", {"question": QUESTION, "context": "docs", "max_new_tokens": 8},
                progress_callback=progress))
            assert told[0][2].startswith("read ") and told[-1][2] == "answering"
            assert [done for done, _, _ in told] == sorted({d for d, _, _ in told})
            assert answer["answer"] and answer["context"] == "docs" and answer["warm"]
            assert answer["sources"] and answer["sources"][0]["path"] in made["files"]
            assert answer["timings"]["total_s"] > 0 and answer["tokens"]["answer"] > 0
            resources = (await client.list_resources()).resources
            assert [str(r.uri) for r in resources] == ["starqa://contexts/docs"]
            too_long = await client.call_tool(
                "ask", {"question": QUESTION, "max_new_tokens": 100_000})
            assert too_long.is_error and "the model was trained on" in too_long.content[0].text

    run(main)


def test_search_and_read_the_files_as_ingested(docs_context, docs):
    """`search` finds a string or regex in the context's files (`path:line` and the lines
    around), `read` gives a file's lines; a file changed on disk since the ingest still
    reads and searches as the context holds it."""
    from mcp import Client

    async def main():
        async with Client(door.server(doors.Service())) as client:
            found = structured(await client.call_tool("search", {"pattern": "retry limit"}))
            assert [m["at"] for m in found["matches"]] == [f"code.py:{i}" for i in range(1, 7)]
            assert found["matches"][1]["before"] == ["retry limit default is seven "]
            regex = structured(await client.call_tool(
                "search", {"pattern": r"approved by the \w+", "regex": True,
                           "paths": "policy/*.md", "around": 0}))
            assert [m["path"] for m in regex["matches"]] == ["policy/travel.md"]
            assert regex["matches"][0]["before"] == []
            lines = structured(await client.call_tool(
                "read", {"path": "code.py", "start": 2, "end": 3}))
            assert lines == {"path": "code.py", "start": 2, "end": 3, "total_lines": 6,
                             "lines": ["retry limit default is seven "] * 2}
            (docs / "code.py").write_text("something else entirely\n")  # changed since
            again = structured(await client.call_tool("read", {"path": "code.py"}))
            assert again["total_lines"] == 6 and "retry limit" in again["lines"][0]
            assert "something" not in " ".join(again["lines"])
            missing = await client.call_tool("read", {"path": "nope.py"})
            assert missing.is_error and "holds no file 'nope.py'" in missing.content[0].text
            bad = await client.call_tool("search", {"pattern": "(", "regex": True})
            assert bad.is_error and "is not a regular expression" in bad.content[0].text

    run(main)
