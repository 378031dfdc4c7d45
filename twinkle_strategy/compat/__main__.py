"""``python -m twinkle_strategy.compat``: every internal twinkle_strategy uses, with the installed version."""

from twinkle_strategy.compat import internals


def main() -> None:
    for internal in internals():
        print(f"{internal.owner} {internal.installed_version()}: {internal.name}\n"
              f"    wrapper: {', '.join(internal.wrappers)}\n    used to {internal.used_for}\n"
              f"    checked on {internal.checked}\n    public replacement: {internal.replacement}")


if __name__ == "__main__":
    main()
