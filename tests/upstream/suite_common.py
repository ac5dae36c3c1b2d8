"""What the runners of upstream's suites (``v1/run_suite.py``, ``v2/run_suite.py``) share."""

# The conftest.py fixture (its file imports pytest and torch.distributed as dist) that destroys,
# after each test, every process group but the world's: gloo runs threads per group, and a suite's
# groups on several ranks would otherwise add up to thousands of threads.
DESTROY_TEST_GROUPS = '''

@pytest.fixture(autouse=True)
def _destroy_test_groups():
    yield
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import GroupMember, _world

        dist.barrier()
        for group in list(_world.pg_map):
            if group is not GroupMember.WORLD:
                dist.destroy_process_group(group)
'''
