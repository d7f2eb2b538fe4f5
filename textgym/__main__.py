from textgym.cli import main

raise SystemExit(main())
