module @jit_s1_fwd_3 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<2x16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg1: tensor<2x16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}) -> (tensor<2x16x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}) {
    %cst = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<2x16x16xf32>
    %1 = stablehlo.multiply %0, %arg0 : tensor<2x16x16xf32>
    %2 = stablehlo.subtract %arg1, %1 : tensor<2x16x16xf32>
    return %2 : tensor<2x16x16xf32>
  }
}
