// Training-throughput benchmark (placeholder).
int main() { return 0; }
