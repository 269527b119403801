from rollstream.testing import check_workflow
from tests.workflow_pkg import MyWorkflow, number_reward

async def test_my_workflow(gconfig, tiny_tokenizer):
    check = await check_workflow(MyWorkflow(gconfig, tiny_tokenizer, number_reward), {"messages": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"})
    assert len(check.episodes) == 4
