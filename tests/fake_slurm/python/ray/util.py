"""fake ray.util: this machine's loopback address stands for the head node's."""


def get_node_ip_address():
    return "127.0.0.1"
