// ddm command-line interface (placeholder until the subcommands land).
#include <iostream>
int main() { std::cout << "ddm\n"; return 0; }
