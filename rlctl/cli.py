def main() -> None:
    print("rlctl")
