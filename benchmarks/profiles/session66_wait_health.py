import sys, time, httpx
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 300):
    try:
        if httpx.get(sys.argv[1], timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit(1)
